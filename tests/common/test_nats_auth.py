"""Each role's NATS key opens only that role's subjects, on a real nats-server started as `rlpipe run` starts it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from services.cli.launch.scaling import forget_presence
from services.common.config import RunConfig, load_config
from services.common.transport import lease_bucket, live_config, presence
from services.common.transport.bus import Bus
from services.common.transport.live_config import KEY, LiveConfig, stored_config
from services.common.transport.nats_auth import RoleKey, write_run_credentials
from services.common.transport.nats_connect import STAGE_ROLES, connect_options
from services.common.transport.presence import (
    Presence,
    SeenService,
    ServiceEntry,
    instance_name,
    presence_key,
    read_presence,
)
from services.common.transport.streams import (
    DEAD,
    EDGES,
    EXPERIENCE,
    PROMPTS,
    ROLLOUTS,
    dead_subject,
    stream_name,
    subject,
)
from services.trainer.lease import Lease
from tests.support.runs import config_file
from tests.support.servers import keyed_nats
from tests.support.waits import until

pytestmark = pytest.mark.integration


@pytest.fixture
def secured(tiny_model, tmp_path: Path) -> Iterator[tuple[RunConfig, dict[str, RoleKey]]]:
    """A broker with the run's per-role keys, as the launcher starts it, and the run's config."""
    with keyed_nats(tmp_path) as (url, keys):
        cfg = load_config(config_file(tmp_path, tiny_model), nats={"url": url})
        yield cfg, keys


def as_role(cfg: RunConfig, keys: dict[str, RoleKey], role: str) -> RunConfig:
    return cfg.model_copy(update={"nats": cfg.nats.model_copy(update={"nkey_seed_file": keys[role].seed_file})})


async def connect(cfg: RunConfig, role: str, errors: list[str]) -> nats.NATS:
    async def remember(error: Exception) -> None:
        errors.append(str(error))

    return await nats.connect(cfg.nats.url, error_cb=remember, **connect_options(cfg.nats, role))


@pytest.mark.unit
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
        trainer = await Bus(as_role(cfg, keys, "trainer"), "trainer").connect()  # creates the streams
        reward = await Bus(as_role(cfg, keys, "reward"), "reward").connect()
        await reward.work_queue("rollouts")  # its own consumer: allowed
        errors: list[str] = []
        nc = await connect(as_role(cfg, keys, "reward"), "reward", errors)
        with pytest.raises(nats.errors.TimeoutError):  # the broker drops the publish, so no stream acks it
            await nc.jetstream().publish(subject("test", EXPERIENCE), b"forged", timeout=2)
        await nc.close()
        await reward.close()
        stored = (await trainer.js.stream_info(stream_name("test", EXPERIENCE))).state.messages
        await trainer.close()
        return errors, stored

    errors, stored = asyncio.run(scenario())

    assert stored == 0
    # nats-py reports the server's -ERR in lower case.
    assert f'nats: permissions violation for publish to "{subject("test", EXPERIENCE)}"' in errors


def test_a_rollout_key_writes_dead_letters_on_its_own_dead_subject_only_and_the_operator_on_its_own(secured):
    """A stage may not write on another role's DEAD subject, the operator's or the bare one, so a DEAD message's
    subject says who wrote it."""
    cfg, keys = secured
    dead = stream_name("test", DEAD)

    async def scenario() -> tuple[list[str], list[str], int]:
        trainer = await Bus(as_role(cfg, keys, "trainer"), "trainer").connect()
        errors: list[str] = []
        rollout = await connect(as_role(cfg, keys, "rollout"), "rollout", errors)
        js = rollout.jetstream()
        await js.publish(dead_subject("test", "rollout"), b"letter", timeout=2)
        for forged_on in (dead_subject("test", "reward"), dead_subject("test", "operator"), subject("test", DEAD)):
            with pytest.raises(nats.errors.TimeoutError):  # dropped by the broker: no stream acks it
                await js.publish(forged_on, b"forged", timeout=2)
        operator_errors: list[str] = []
        operator = await connect(as_role(cfg, keys, "operator"), "operator", operator_errors)
        await operator.jetstream().publish(dead_subject("test", "operator"), b"record", timeout=2)
        with pytest.raises(nats.errors.TimeoutError):
            await operator.jetstream().publish(dead_subject("test", "trainer"), b"forged", timeout=2)
        await rollout.close()
        await operator.close()
        stored = (await trainer.js.stream_info(dead)).state.messages
        await trainer.close()
        return errors, operator_errors, stored

    errors, operator_errors, stored = asyncio.run(scenario())

    assert stored == 2  # the rollout's own letter and the operator's record
    assert sorted(errors) == sorted(
        violation(s) for s in (dead_subject("test", "reward"), dead_subject("test", "operator"), subject("test", DEAD))
    )
    assert operator_errors == [violation(dead_subject("test", "trainer"))]


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


def violation(subject_name: str) -> str:
    """The error nats-py reports for a refused publish (it lower-cases the server's -ERR)."""
    return f'nats: permissions violation for publish to "{subject_name.lower()}"'


def test_a_stage_key_may_not_create_update_or_delete_a_stream_nor_create_a_bucket_the_trainers_may(secured):
    cfg, keys = secured
    experience = stream_name("test", EXPERIENCE)
    config_bucket = live_config.bucket_name("test")

    async def scenario() -> tuple[dict[str, list[str]], list[str]]:
        trainer = await Bus(as_role(cfg, keys, "trainer"), "trainer").connect()  # creates every stream
        wanted = trainer.stream_config(EXPERIENCE)
        shrunk = dataclasses.replace(wanted, max_msgs=1)  # a stage must not cut what the trainer re-reads
        refused: dict[str, list[str]] = {}
        for role in STAGE_ROLES:
            errors: list[str] = []
            nc = await connect(as_role(cfg, keys, role), role, errors)
            js = nc.jetstream(timeout=1)
            attempts = await asyncio.gather(
                js.add_stream(shrunk),
                js.update_stream(shrunk),
                js.delete_stream(experience),
                js.create_key_value(bucket=config_bucket),
                return_exceptions=True,
            )
            assert all(isinstance(attempt, nats.errors.TimeoutError) for attempt in attempts), (role, attempts)
            await nc.close()
            refused[role] = errors
        after = await trainer.js.stream_info(experience)
        assert after.config.max_msgs == -1 and after.config.retention == wanted.retention
        with pytest.raises(BucketNotFoundError):
            await trainer.js.key_value(config_bucket)
        # The trainer's own key: updates the stream and creates the bucket, but deletes no stream either.
        trainer_errors: list[str] = []
        owner = await connect(as_role(cfg, keys, "trainer"), "trainer", trainer_errors)
        owner_js = owner.jetstream(timeout=1)
        assert (await owner_js.update_stream(shrunk)).config.max_msgs == 1
        await LiveConfig(cfg, owner_js).start()
        assert (await (await owner_js.key_value(config_bucket)).status()).bucket == config_bucket
        with pytest.raises(nats.errors.TimeoutError):
            await owner_js.delete_stream(experience)
        await owner.close()
        await trainer.close()
        return refused, trainer_errors

    refused, trainer_errors = asyncio.run(scenario())

    for role in STAGE_ROLES:
        assert sorted(refused[role]) == sorted(
            violation(f"$JS.API.STREAM.{action}.{stream}")
            for action, stream in (
                ("CREATE", experience),
                ("UPDATE", experience),
                ("DELETE", experience),
                ("CREATE", f"KV_{config_bucket}"),
            )
        ), role
    assert trainer_errors == [violation(f"$JS.API.STREAM.DELETE.{experience}")]


def test_a_stage_started_before_the_trainer_waits_for_each_stream_and_bucket_then_goes_on(secured, caplog):
    """A reward replica up first starts as run_service does (stored config, bus, live config, presence, its work
    queue) with its own key: it waits for each thing the trainer creates, and goes on once it exists."""
    cfg, keys = secured
    reward_cfg, trainer_cfg = as_role(cfg, keys, "reward"), as_role(cfg, keys, "trainer")
    caplog.set_level(logging.INFO)

    def waited_for() -> list[str]:
        return [r.fields["what"] for r in caplog.records if r.getMessage() == "waiting_for_trainer"]

    async def until_waiting_for(what: str, reward: asyncio.Task) -> None:
        for _ in range(100):
            if what in waited_for():
                assert not reward.done()
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"reward did not wait for {what}: {waited_for()}")

    async def start_reward() -> tuple[Bus, Presence]:
        started = await stored_config(reward_cfg, "reward")
        bus = await Bus(started, "reward").connect()
        live = await LiveConfig(started, bus.js, creates_bucket=bus.creates_streams).start()
        replica = await Presence(bus.js, started, "reward", live).start()
        await bus.work_queue(ROLLOUTS)
        return bus, replica

    async def scenario() -> list[dict]:
        reward = asyncio.create_task(start_reward())
        await until_waiting_for(f"bucket {live_config.bucket_name('test')}", reward)
        trainer_nc = await nats.connect(cfg.nats.url, **connect_options(trainer_cfg.nats, "trainer"))
        live = await LiveConfig(trainer_cfg, trainer_nc.jetstream()).start()
        await until_waiting_for(f"stream {stream_name('test', 'prompts')}", reward)
        trainer = await Bus(trainer_cfg, "trainer").connect()
        await until_waiting_for(f"bucket {presence.bucket_name('test')}", reward)
        trainer_presence = await Presence(trainer.js, trainer_cfg, "trainer", live).start()
        bus, replica = await asyncio.wait_for(reward, timeout=30)
        consumer = await trainer.js.consumer_info(stream_name("test", ROLLOUTS), "reward")
        assert consumer.config.durable_name == "reward"
        entries = await read_presence(trainer.js, trainer_cfg.run_id, trainer_cfg.nats)
        for closing in (replica, trainer_presence):
            await closing.stop()
        for connection in (bus, trainer):
            await connection.close()
        await trainer_nc.close()
        return entries

    entries = asyncio.run(scenario())

    assert sorted(entry.role for entry in entries) == ["reward", "trainer"]
    waits = waited_for()
    assert waits[:2] == [f"bucket {live_config.bucket_name('test')}", f"stream {stream_name('test', 'prompts')}"]
    assert waits[-1] == f"bucket {presence.bucket_name('test')}"
    # The trainer creates the streams one by one, so the reward may look between two creations and wait once more
    # for a later stream; each such wait names a stream after PROMPTS, in the order they are made, at most once.
    later_streams = [f"stream {stream_name('test', edge)}" for edge in EDGES[EDGES.index(PROMPTS) + 1 :]]
    between = waits[2:-1]
    assert between == [name for name in later_streams if name in between]
    assert len([r for r in caplog.records if r.getMessage() == "trainer_state_found"]) == len(waits)
    # It never tried what its key may not do: the broker refused nothing.
    assert not [r for r in caplog.records if "permissions violation" in str(r.exc_info or r.getMessage()).lower()]


def test_the_trainer_key_takes_and_renews_the_run_lease_and_a_stage_key_may_not_write_it(secured):
    cfg, keys = secured
    lease_name = lease_bucket.bucket_name("test")

    async def scenario() -> tuple[list[str], list[str], int]:
        trainer_errors: list[str] = []
        trainer = await connect(as_role(cfg, keys, "trainer"), "trainer", trainer_errors)
        kv = await lease_bucket.open_bucket(trainer.jetstream(timeout=2), "test", "file", 1)
        lease = Lease(kv, "test", ttl_s=30.0)
        epoch = await lease.acquire()
        await lease.renew()
        errors: list[str] = []
        reward = await connect(as_role(cfg, keys, "reward"), "reward", errors)
        with pytest.raises(nats.errors.TimeoutError):
            await reward.jetstream(timeout=1).publish(f"$KV.{lease_name}.trainer", b"{}")
        assert (await kv.get("trainer")).revision == lease.revision  # the stage's write never landed
        await reward.close()
        await trainer.close()
        return trainer_errors, errors, epoch

    trainer_errors, errors, epoch = asyncio.run(scenario())

    assert (trainer_errors, epoch) == ([], 1)
    assert errors == [violation(f"$KV.{lease_name}.trainer")]


def test_a_rollout_key_writes_its_own_presence_entries_but_not_the_trainers_nor_a_rollup_of_the_bucket(secured):
    cfg, keys = secured
    bucket = presence.bucket_name("test")
    trainer_key = presence_key("trainer", instance_name(cfg.service, "trainer"))
    rollout_cfg = as_role(cfg, keys, "rollout")

    async def scenario() -> tuple[list[str], dict[str, SeenService], list[str]]:
        trainer_errors: list[str] = []
        trainer_nc = await connect(as_role(cfg, keys, "trainer"), "trainer", trainer_errors)
        trainer = await Presence(trainer_nc.jetstream(), as_role(cfg, keys, "trainer"), "trainer").start(
            grpc="127.0.0.1:4567"
        )
        errors: list[str] = []
        nc = await connect(rollout_cfg, "rollout", errors)
        js = nc.jetstream(timeout=1)

        def named(instance: str) -> RunConfig:
            return rollout_cfg.model_copy(
                update={"service": rollout_cfg.service.model_copy(update={"instance": instance})}
            )

        rollout = await Presence(js, named("r-0"), "rollout").start()  # its own entry: allowed
        departed = await Presence(js, named("r-1"), "rollout").start()
        await departed.stop()
        kv = await js.key_value(bucket)
        forged = ServiceEntry(role="trainer", instance="t", time=time.time(), grpc="127.0.0.1:1111")
        with pytest.raises(nats.errors.TimeoutError):
            await kv.put(trainer_key, forged.model_dump_json().encode())
        with pytest.raises(nats.errors.TimeoutError):
            await kv.delete(trainer_key)
        # A rollup, even on its own key, would remove every entry: the stream refuses it.
        with pytest.raises(nats.js.errors.APIError, match=r"(?i)rollup"):
            await js.publish(f"$KV.{bucket}.rollout.r-0", b"{}", headers={"Nats-Rollup": "all"})
        # The launcher forgets a departed rollout's entry with the rollout's key.
        assert await asyncio.to_thread(forget_presence, cfg, cfg.nats.url, keys["rollout"], "r-1")
        entries = {presence_key(e.role, e.instance): e for e in await read_presence(trainer.js, "test", cfg.nats)}
        await rollout.stop()
        await trainer.stop()
        await nc.close()
        await trainer_nc.close()
        return errors, entries, trainer_errors

    errors, entries, trainer_errors = asyncio.run(scenario())

    assert sorted(entries) == ["rollout.r-0", trainer_key]
    assert entries[trainer_key].grpc == "127.0.0.1:4567" and entries[trainer_key].up
    assert errors == [violation(f"$KV.{bucket}.{trainer_key}")] * 2
    assert trainer_errors == []


def test_an_entry_under_a_rollout_key_claiming_the_trainer_role_is_left_out_and_never_names_the_trainer_port(
    secured, caplog
):
    """The review's attack: a rollout writes a `trainer` entry under a key it may write, naming a port it chose;
    rollouts started with the trainer would dial it and send it the weight-sync token."""
    cfg, keys = secured
    trainer_cfg, rollout_cfg = as_role(cfg, keys, "trainer"), as_role(cfg, keys, "rollout")
    caplog.set_level(logging.WARNING)

    def malformed() -> list[str]:
        return [r.fields["key"] for r in caplog.records if r.getMessage() == "presence_malformed"]

    async def scenario() -> tuple[int, list[SeenService]]:
        trainer_nc = await nats.connect(cfg.nats.url, **connect_options(trainer_cfg.nats, "trainer"))
        await presence.open_bucket(trainer_nc.jetstream(), "test", trainer_cfg.nats)  # the trainer creates it
        nc = await nats.connect(cfg.nats.url, **connect_options(rollout_cfg.nats, "rollout"))
        js = nc.jetstream(timeout=2)
        since = time.time()
        forged = ServiceEntry(role="trainer", instance="x", time=time.time() + 3600, grpc="127.0.0.1:1111")
        kv = await js.key_value(presence.bucket_name("test"))
        await kv.put("rollout.x", forged.model_dump_json().encode())
        waiting = asyncio.create_task(presence.await_trainer_port(js, "test", rollout_cfg.nats, since))
        await until(lambda: malformed().count("rollout.x") >= 3, 30, "the forged entry read and left out thrice")
        assert not waiting.done()
        trainer = await Presence(trainer_nc.jetstream(), trainer_cfg, "trainer").start(grpc="127.0.0.1:4567")
        port = await asyncio.wait_for(waiting, 10)
        entries = await read_presence(js, "test", rollout_cfg.nats)
        await trainer.stop()
        await nc.close()
        await trainer_nc.close()
        return port, entries

    port, entries = asyncio.run(scenario())

    assert port == 4567
    assert [(e.role, e.grpc) for e in entries] == [("trainer", "127.0.0.1:4567")]
    assert set(malformed()) == {"rollout.x"}


def test_a_bucket_an_older_build_made_is_upgraded_at_the_trainers_start_to_refuse_rollups_and_drop_bare_keys(
    secured, caplog
):
    """A run resumed across the upgrade: its bucket allows rollups and keys entries by bare instance name."""
    cfg, keys = secured
    trainer_cfg, reward_cfg = as_role(cfg, keys, "trainer"), as_role(cfg, keys, "reward")
    bucket = presence.bucket_name("test")
    caplog.set_level(logging.INFO)

    def reward_named(instance: str) -> RunConfig:
        return reward_cfg.model_copy(update={"service": reward_cfg.service.model_copy(update={"instance": instance})})

    async def scenario() -> tuple[bool, list[tuple[str, str, int]]]:
        trainer_nc = await nats.connect(cfg.nats.url, **connect_options(trainer_cfg.nats, "trainer"))
        js = trainer_nc.jetstream()
        old = await js.create_key_value(bucket=bucket, history=1)  # as the older build made it
        now = time.time()
        for key, role in (("trainer", "trainer"), ("reward-0", "reward")):
            await old.put(key, ServiceEntry(role=role, instance=key, time=now).model_dump_json().encode())
        trainer = await Presence(js, trainer_cfg, "trainer").start()
        allows_rollups = (await js.stream_info(f"KV_{bucket}")).config.allow_rollup_hdrs
        nc = await nats.connect(cfg.nats.url, **connect_options(reward_cfg.nats, "reward"))
        reward = await Presence(nc.jetstream(timeout=2), reward_named("reward-0"), "reward").start()
        await reward.stop(orderly=True)
        again = await Presence(nc.jetstream(timeout=2), reward_named("reward-0"), "reward").start()  # a restart
        entries = await read_presence(js, "test", trainer_cfg.nats)
        await again.stop()
        await trainer.stop()
        await nc.close()
        await trainer_nc.close()
        return bool(allows_rollups), [(e.role, e.instance, e.restarts) for e in entries]

    allows_rollups, entries = asyncio.run(scenario())

    assert not allows_rollups
    trainer_instance = instance_name(cfg.service, "trainer")
    assert entries == [("reward", "reward-0", 1), ("trainer", trainer_instance, 0)]
    assert [r.getMessage() for r in caplog.records].count("presence_upgraded") == 1
    assert not [r for r in caplog.records if r.getMessage() in ("presence_malformed", "presence_failed")]
