"""Refusals: what a service raises when it cannot run as it finds its config or the world around it.

A refusal is not a crash: restarting the service would fail the same way (a consumer JetStream cannot update, a
broker that takes smaller messages than the config sends), or worse. ``run_service`` turns one into a
``start_refused`` event carrying the reason and exit ``EXIT_REFUSED`` (2), which ``rlpipe run`` does not restart:
it prints the reason and ends the run with 2.
"""

from __future__ import annotations


class StartRefused(RuntimeError):
    """This service cannot run as configured; the message says why and what to change."""
