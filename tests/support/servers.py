"""The real servers a test starts: free ports, nats-server with JetStream, moto_server as the S3 endpoint, and a
warm-start pool. Each is stopped by whoever started it (the fixtures in ``tests.support.fixtures``, or the test)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.paths import BIN, ROOT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout}s")


def start_nats(store: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    process = subprocess.Popen(
        [str(BIN / "nats-server"), "-js", "-sd", str(store), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port, process, "nats-server")
    return process, f"nats://127.0.0.1:{port}"


@contextlib.contextmanager
def keyed_nats(folder: Path, run_id: str = "test") -> Iterator[tuple[str, dict]]:
    """A broker with the run's per-role keys, started as the launcher starts it: (its URL, each role's key)."""
    from services.common.transport.nats_auth import server_authorization, write_run_credentials
    from services.common.transport.nats_server import embedded_config, nats_server_binary

    keys = write_run_credentials(folder / "nats-auth")
    port = free_port()
    conf = folder / "nats.conf"
    conf.write_text(embedded_config(port, folder / "store", False, server_authorization(run_id, list(keys.values()))))
    server = subprocess.Popen(
        [nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_port(port, server, "nats-server")
        yield f"nats://127.0.0.1:{port}", keys
    finally:
        server.terminate()
        server.wait(timeout=10)


async def create_run_state(cfg) -> None:
    """The run's streams and buckets, as the trainer creates them at start: a stage only waits for them."""
    from services.common.transport.bus import Bus
    from services.common.transport.live_config import LiveConfig
    from services.common.transport.presence import open_bucket

    bus = await Bus(cfg, "trainer").connect()
    await LiveConfig(cfg, bus.js).start()
    await open_bucket(bus.js, cfg.run_id, cfg.nats)
    await bus.close()


def start_moto(port: int) -> subprocess.Popen:
    """moto_server on ``port``, once it listens."""
    process = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port, process, "moto_server")
    return process


class StoppableS3:
    """A moto_server that a test stops and starts again on the same port (it comes back empty)."""

    def __init__(self):
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.process = start_moto(self.port)

    def stop(self) -> None:
        self.process.kill()  # a no-op on one already stopped
        self.process.wait()

    def checkpoint(self, **settings) -> dict:
        """The run config's checkpoint section for this endpoint."""
        return {
            "store_url": "s3://ckpt/prefix",
            "s3_endpoint": f"127.0.0.1:{self.port}",
            "s3_secure": False,
            **settings,
        }


@contextlib.contextmanager
def running_warm_pool(modules: list[str], log_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`python -m services.cli.launch.warm_start --listen SOCKET MODULES...` from the repository root, yielding its
    process and socket once it listens (it imports after, and a launcher joining meanwhile waits for them); killed
    after. The socket is in a short temporary folder: its path must fit in 108 bytes, which a deep --basetemp may
    not."""
    from services.common.parent_death import die_with_parent

    socket_path = Path(tempfile.mkdtemp(prefix="rlpipe-pool-")) / "pool.sock"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli.launch.warm_start", "--listen", str(socket_path), *modules],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    try:
        deadline = time.monotonic() + 60
        while not socket_path.exists():
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        yield process, socket_path
    finally:
        process.kill()
        process.wait()
        shutil.rmtree(socket_path.parent, ignore_errors=True)


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for "localhost" and its key, written to ``folder``: (certificate, key)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "admin.crt", folder / "admin.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def start_reward_server(port: int, *options: str) -> subprocess.Popen:
    """The reference HTTP reward server (services.reward.reference_server) on ``port``, once it listens."""
    server = subprocess.Popen(
        [sys.executable, "-m", "services.reward.reference_server", "--port", str(port), *options],
        stdout=subprocess.DEVNULL,
    )
    wait_for_port(port, server, "reference reward server")
    return server


class RedirectingService:
    """A real HTTP server that answers every request with ``status`` and a Location on ``target``, and a target
    that records the method and Authorization header of every request it gets."""

    def __init__(self, status: int):
        import http.server
        import threading

        self.reached: list[tuple[str, str | None]] = []
        service = self

        class Target(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                service.reached.append((self.command, self.headers.get("Authorization")))
                body = b'{"scores": [1.0]}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = answer

            def log_message(self, *args) -> None:
                pass

        self.target = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Target)
        location = f"http://localhost:{self.target.server_address[1]}/score"

        class Redirect(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(status)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
        self.port = self.server.server_address[1]
        for server in (self.server, self.target):
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def close(self) -> None:
        for server in (self.server, self.target):
            server.shutdown()
            server.server_close()
