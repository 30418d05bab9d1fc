"""The NATS server configs we ship fsync every write and are accepted by a real nats-server."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from services.common.config import NatsConfig
from tests.support.deploy import DEPLOY, k8s_conf_with_secrets, local_compose_conf, make_compose_secrets
from tests.support.paths import BIN
from tests.support.runs import config_file
from tests.support.servers import free_port

pytestmark = pytest.mark.integration

COMPOSE_CONF = DEPLOY / "nats" / "nats.conf"
K8S_CONF = DEPLOY / "k8s" / "base" / "nats" / "nats.conf"


def jetstream_block(conf: str) -> str:
    match = re.search(r"^jetstream\s*\{(.*?)^\}", conf, re.MULTILINE | re.DOTALL)
    assert match, "no jetstream { } block"
    return match.group(1)


@pytest.mark.unit
@pytest.mark.parametrize("path", [COMPOSE_CONF, K8S_CONF], ids=["compose", "k8s"])
def test_jetstream_fsyncs_every_write(path: Path):
    block = jetstream_block(path.read_text())
    assert re.search(r"^\s*sync_interval:\s*always\s*$", block, re.MULTILINE)
    assert re.search(r"^\s*store_dir:\s*/data\s*$", block, re.MULTILINE)


def compose_conf_with_secrets(folder: Path, model: tuple[Path, Path], port: int, monitor: int) -> Path:
    """The compose config runnable here: secrets made as secrets-init makes them, paths moved into ``folder``."""
    config = config_file(folder, model)
    made = make_compose_secrets(folder / "secrets", config)
    assert made.returncode == 0, made.stderr
    return local_compose_conf(folder, port, monitor)


@pytest.mark.parametrize("which", ["compose", "k8s"])
def test_nats_server_accepts_the_config(which: str, tiny_model, tmp_path: Path):
    if which == "compose":
        path = compose_conf_with_secrets(tmp_path, tiny_model, 4222, 8222)
    else:
        path = k8s_conf_with_secrets(tmp_path)
    done = subprocess.run(
        [str(BIN / "nats-server"), "-c", str(path), "-t"],
        env={"POD_NAME": "nats-0"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_broker_starts_healthy_with_fsync_always(tiny_model, tmp_path: Path):
    """The compose config run for real; only its store, ports and secrets are moved to this test's."""
    client, monitor = free_port(), free_port()
    compose_conf_with_secrets(tmp_path, tiny_model, client, monitor)
    server = subprocess.Popen(
        [str(BIN / "nats-server"), "-c", str(tmp_path / "nats.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", timeout=2
                ) as reply:
                    assert json.load(reply) == {"status": "ok"}
                break
            except OSError:
                assert server.poll() is None, "nats-server exited"
                assert time.monotonic() < deadline, "nats-server never became healthy"
                time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=5) as reply:
            varz = json.load(reply)
        assert varz["jetstream"]["config"]["sync_always"] is True
        # Our largest message (nats.max_message_bytes, then claim checks) must fit the server's limit.
        assert varz["max_payload"] > NatsConfig().max_message_bytes
    finally:
        server.terminate()
        server.wait(timeout=10)
