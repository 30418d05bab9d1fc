"""The broker of a local run (``rlpipe run``): one nats-server with JetStream, its store in the run directory.

Every role connects with a key of its own (``nats_auth.write_run_credentials``, fresh at every start), so the
server's authorization lists those keys. Restarted on the same port and store, it brings back the run's streams,
consumers and unacknowledged messages, and the clients reconnect. It dies with the launcher (``die_with_parent``).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Callable

import nats

from services.cli.launch.children import free_port
from services.common.config import RunConfig
from services.common.parent_death import dies_with_this_process
from services.common.transport.live_config import Hold, HoldSource, LiveConfig
from services.common.transport.nats_auth import RoleKey, server_authorization
from services.common.transport.nats_connect import connect_options
from services.common.transport.nats_server import embedded_config, nats_server_binary

ACCEPT_TIMEOUT_S = 30.0


class RunBroker:
    """The run's nats-server: ``start`` (again after it died, on the same port), ``stop``, ``kill``."""

    def __init__(self, cfg: RunConfig, keys: dict[str, RoleKey]):
        self.cfg = cfg
        self.keys = keys
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The running server's process id (``start`` comes first)."""
        if self.process is None:
            raise RuntimeError("nats-server is not started: RunBroker.start comes first")
        return self.process.pid

    def start(self) -> str:
        """Start the server (on the port it had, or a free one the first time) and return its URL once it accepts
        connections."""
        self.port = self.port or free_port()
        run_dir = self.cfg.run_dir
        store = run_dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        logs = run_dir / "logs"
        # The server's own log rotates (service.log_max_mib, service.log_keep); what it prints before that log
        # opens (a config error) or when it crashes goes to nats.out, which a healthy server never writes to.
        out = (logs / "nats.out").open("ab")
        conf = run_dir / "nats.conf"
        authorization = server_authorization(self.cfg.run_id, list(self.keys.values()))
        log = ((logs / "nats.log").resolve(), self.cfg.service)
        conf.write_text(embedded_config(self.port, store, self.cfg.nats.sync_always, authorization, log))
        self.process = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=dies_with_this_process(),
        )
        out.close()  # the child holds its own copy
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.process.returncode}; see {logs}/nats.out and nats.log"
                )
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self.url
            time.sleep(0.05)
        raise RuntimeError(f"nats-server did not accept connections within {ACCEPT_TIMEOUT_S:.0f} s")

    def exit_code(self) -> int | None:
        """None while the server runs (or before it started), else how it ended."""
        return self.process.poll() if self.process is not None else None

    def release_hold(self) -> Hold:
        """For ``--resume``, which continues on purpose: clear the run's recorded pause or stop unless an alert set
        it (``Hold.outlives_resume``: an operator lifts that one with ``rlpipe resume`` after looking); returns what
        was recorded."""
        return self._set_control(lambda earlier: None if earlier.outlives_resume else Hold())

    def hold(self, reason: str) -> None:
        """Record the run as paused before its trainer starts: it starts held (``Control.restore_hold``), its stages
        ready and idle, until an operator (or the tool that asked) resumes it. A hold an alert set stays instead:
        the run starts held either way, and a later ``--resume`` must still find the alert's."""
        self._set_control(lambda earlier: None if earlier.outlives_resume else Hold(True, reason, HoldSource.START))

    def _set_control(self, change: Callable[[Hold], Hold | None]) -> Hold:
        """Store ``change(earlier)`` (None: leave it) as the run's operator state, as the trainer would; returns the
        earlier one."""

        async def put() -> Hold:
            as_trainer = self.cfg.nats.model_copy(update={"nkey_seed_file": self.keys["trainer"].seed_file})
            nc = await nats.connect(self.url, **connect_options(as_trainer, "trainer"))
            try:
                live = await LiveConfig(self.cfg, nc.jetstream()).start()
                earlier = Hold.of_record(await live.get_control())
                if (changed := change(earlier)) is not None:
                    await live.put_control(changed.record())
                return earlier
            finally:
                await nc.close()

        return asyncio.run(put())

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
