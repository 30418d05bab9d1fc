"""The container health probe against real gRPC servers: it follows the run's config onto a TLS port, where a
plaintext probe only ever fails (weight_sync.tls_*)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.common.config import load_config
from services.common.service import start_grpc_server
from services.common.transport.weight_sync_tls import ROLLOUT, TRAINER, server_credentials
from tests.support.paths import ROOT
from tests.support.runs import write_config
from tests.support.servers import self_signed

pytestmark = pytest.mark.integration


def probe(*args: str) -> subprocess.CompletedProcess:
    """The probe as compose, the Dockerfile and the k8s exec probes run it: its own process."""
    command = [sys.executable, "-m", "services.cli.healthcheck", "--timeout", "3", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


def tls_config(tmp_path: Path, tiny_model, port: int, **sections: dict) -> Path:
    model_dir, data_dir = tiny_model
    cert, key = tmp_path / "admin.crt", tmp_path / "admin.key"
    if not cert.exists():  # one certificate per test: the server's, and the one every config names
        self_signed(tmp_path)  # names localhost, the trainer's host below
    return write_config(
        tmp_path / f"c-{port}.yaml",
        model_dir,
        data_dir,
        tmp_path / "runs",
        service={"host": "0.0.0.0", "trainer_host": "localhost", "trainer_grpc_port": port, "grpc_port": port},
        weight_sync={"tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(cert)},
        **sections,
    )


async def serve(credentials: grpc.ServerCredentials | None, cfg) -> tuple[grpc.aio.Server, int]:
    server, address = await start_grpc_server(cfg, 0, credentials=credentials)
    return server, int(address.rpartition(":")[2])


def test_the_probe_speaks_tls_to_a_tls_trainer_port_where_a_plaintext_probe_fails(tiny_model, tmp_path):
    cfg = load_config(tls_config(tmp_path, tiny_model, 0))

    async def scenario() -> tuple[subprocess.CompletedProcess, ...]:
        server, port = await serve(server_credentials(cfg.weight_sync, cfg.rollout, TRAINER), cfg)
        try:
            config = tls_config(tmp_path, tiny_model, port)
            plain = tmp_path / "plain.yaml"
            plain.write_text(config.read_text().split("weight_sync:")[0])  # the same run without TLS set
            return await asyncio.gather(
                asyncio.to_thread(probe, "--config", str(config), "--role", "trainer"),
                asyncio.to_thread(probe, f"127.0.0.1:{port}"),
                asyncio.to_thread(probe, "--config", str(plain), "--role", "trainer"),
            )
        finally:
            await server.stop(0)

    by_config, plaintext, untold = asyncio.run(scenario())
    assert by_config.returncode == 0, by_config.stderr
    assert plaintext.returncode == 1 and plaintext.stderr.startswith("unhealthy: 127.0.0.1:")
    assert untold.returncode == 1 and "UNAVAILABLE" in untold.stderr


def test_the_probe_of_a_relaying_rollout_speaks_tls_and_of_one_that_does_not_relay_plaintext(tiny_model, tmp_path):
    relaying = load_config(tls_config(tmp_path, tiny_model, 0))
    direct = load_config(tls_config(tmp_path, tiny_model, 0, rollout={"weight_relay": False}))
    assert (
        server_credentials(direct.weight_sync, direct.rollout, ROLLOUT) is None
    )  # its port carries no weights: plaintext, as the others'

    async def scenario() -> tuple[subprocess.CompletedProcess, ...]:
        tls_server, tls_port = await serve(
            server_credentials(relaying.weight_sync, relaying.rollout, ROLLOUT), relaying
        )
        plain_server, plain_port = await serve(None, direct)
        try:
            return await asyncio.gather(
                asyncio.to_thread(
                    probe, "--config", str(tls_config(tmp_path, tiny_model, tls_port)), "--role", "rollout"
                ),
                asyncio.to_thread(
                    probe,
                    "--config",
                    str(tls_config(tmp_path, tiny_model, plain_port, rollout={"weight_relay": False})),
                    "--role",
                    "rollout",
                ),
            )
        finally:
            await tls_server.stop(0)
            await plain_server.stop(0)

    for done in asyncio.run(scenario()):
        assert done.returncode == 0, done.stderr


@pytest.mark.unit
def test_a_probe_told_half_of_what_it_needs_says_so():
    from services.cli.healthcheck import main

    with pytest.raises(SystemExit) as refused:
        main(["--role", "trainer"])
    assert refused.value.code == 2
    with pytest.raises(SystemExit):
        main([])
