"""What every role shares, by concern: ``config``, ``registry`` and ``sandbox`` at the base, ``observe``,
``transport`` and ``model`` above it, and the service runtime (``service``, ``startup_checks``) on top.
tests/test_layering.py states which may import which; nothing here imports a role or a CLI."""
