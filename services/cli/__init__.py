"""The operator's commands: one ``rlpipe`` typer app (``app``) and the modules behind its commands.

Run by people and by deployment probes, never by a role: roles import ``services.common`` only, and nothing in
``services.common`` or a role imports from here (tests/test_layering.py).
"""
