"""A box for code the model wrote: its own user, PID, network and mount namespaces and a system-call filter, built by
the kernel.

``Box(limits).run(code)`` runs Python code and says how it ended (``Outcome``); ``probe()`` says whether a box
can be built on this machine. ``boot.py`` is the program that builds it (it runs where the project is not
visible, so it imports the standard library alone); ``seccomp.py`` builds the filter's program for it. What it
guarantees and what it does not: docs/agents.md, "The box"."""

from services.common.sandbox.box import Box, BoxFailed, BoxLimits, Outcome, probe

__all__ = ["Box", "BoxFailed", "BoxLimits", "Outcome", "probe"]
