"""Each role's NATS key opens only that role's subjects, on a real nats-server started as `rlpipe run` starts it."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.js.errors import KeyNotFoundError

from services.common.bus import EXPERIENCE, Bus, stream_name, subject
from services.common.config import RunConfig, load_config
from services.common.live_config import KEY, LiveConfig
from services.common.nats_auth import RoleKey, server_authorization, write_run_credentials
from services.common.nats_connect import connect_options
from services.common.nats_server import embedded_config, nats_server_binary
from tests.conftest import free_port, wait_for_port, write_config


@pytest.fixture
def secured(tiny_model, tmp_path: Path) -> Iterator[tuple[RunConfig, dict[str, RoleKey]]]:
    """A broker with the run's per-role keys, as the launcher starts it, and the run's config."""
    keys = write_run_credentials(tmp_path / "nats-auth")
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(embedded_config(port, tmp_path / "store", False, server_authorization("test", list(keys.values()))))
    server = subprocess.Popen(
        [nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_port(port, server, "nats-server")
    model_dir, data_dir = tiny_model
    cfg = load_config(
        write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs"),
        nats={"url": f"nats://127.0.0.1:{port}"},
    )
    yield cfg, keys
    server.terminate()
    server.wait(timeout=10)


def as_role(cfg: RunConfig, keys: dict[str, RoleKey], role: str) -> RunConfig:
    return cfg.model_copy(update={"nats": cfg.nats.model_copy(update={"nkey_seed_file": keys[role].seed_file})})


async def connect(cfg: RunConfig, role: str, errors: list[str]) -> nats.NATS:
    async def remember(error: Exception) -> None:
        errors.append(str(error))

    return await nats.connect(cfg.nats.url, error_cb=remember, **connect_options(cfg.nats, role))


def test_seed_files_are_readable_by_their_owner_only(tmp_path):
    keys = write_run_credentials(tmp_path / "nats-auth")
    assert sorted(keys) == ["operator", "reference", "reward", "rollout", "trainer"]
    assert (tmp_path / "nats-auth").stat().st_mode & 0o777 == 0o700
    for key in keys.values():
        assert key.seed_file.stat().st_mode & 0o777 == 0o600
        assert key.seed_file.read_text().startswith("SU") and key.public_key.startswith("U")


def test_a_connection_without_a_key_is_refused(secured):
    cfg, _ = secured

    with pytest.raises(Exception, match="Authorization Violation"):
        asyncio.run(nats.connect(cfg.nats.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3))


def test_reward_consumes_rollouts_but_publishing_to_experience_is_a_permissions_violation(secured):
    cfg, keys = secured

    async def scenario() -> tuple[list[str], int]:
        reward = await Bus(as_role(cfg, keys, "reward"), "reward").connect()
        await reward.work_queue("rollouts")  # its own consumer: allowed
        errors: list[str] = []
        nc = await connect(as_role(cfg, keys, "reward"), "reward", errors)
        with pytest.raises(nats.errors.TimeoutError):  # the broker drops the publish, so no stream acks it
            await nc.jetstream().publish(subject("test", EXPERIENCE), b"forged", timeout=2)
        await nc.close()
        await reward.close()
        trainer = await Bus(as_role(cfg, keys, "trainer"), "trainer").connect()
        stored = (await trainer.js.stream_info(stream_name("test", EXPERIENCE))).state.messages
        await trainer.close()
        return errors, stored

    errors, stored = asyncio.run(scenario())

    assert stored == 0
    # nats-py reports the server's -ERR in lower case.
    assert f'nats: permissions violation for publish to "{subject("test", EXPERIENCE)}"' in errors


def test_config_writes_with_a_stage_key_are_refused_and_the_trainers_are_taken(secured):
    cfg, keys = secured

    async def scenario() -> tuple[list[str], int]:
        trainer_errors: list[str] = []
        trainer = await connect(as_role(cfg, keys, "trainer"), "trainer", trainer_errors)
        trainer_config = await LiveConfig(cfg, trainer.jetstream()).start()
        errors: list[str] = []
        reward = await connect(as_role(cfg, keys, "reward"), "reward", errors)
        reward_config = await LiveConfig(cfg, reward.jetstream()).start()  # reading its config: allowed
        with pytest.raises(nats.errors.TimeoutError):
            await reward_config.kv.put(KEY, b'{"overrides": {"train.learning_rate": 1.0}}')
        with pytest.raises(KeyNotFoundError):
            await trainer_config.kv.get(KEY)
        revision = await trainer_config.kv.put("control", b"{}")
        await reward.close()
        await trainer.close()
        assert trainer_errors == []
        return errors, revision

    errors, revision = asyncio.run(scenario())

    assert revision == 1
    assert 'nats: permissions violation for publish to "$kv.rlpipe_test_config.current"' in errors
