"""Service presence in a real JetStream key-value bucket."""

import asyncio
import contextlib
import json
import time

import nats
import pytest

from services.common.config import ServiceConfig
from services.common.service import watch_progress
from services.common.transport import presence as presence_module
from services.common.transport.presence import (
    HEARTBEAT_S,
    Presence,
    SeenService,
    await_trainer_port,
    gone_for,
    instance_name,
    key_role,
    open_bucket,
    presence_key,
    read_presence,
    role_time_shares,
    roles_down,
)
from tests.support.runs import run_config
from tests.support.waits import until

pytestmark = pytest.mark.integration


def test_every_registered_replica_is_read_back_every_time(tiny_model, tmp_path, nats_url):
    cfg = run_config(tmp_path, tiny_model, run_id="presence", nats={"url": nats_url})

    async def scenario():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        # The trainer's read creates the bucket, which the stages wait for.
        await read_presence(js, cfg.run_id, cfg.nats)
        replicas = [
            await Presence(
                js, cfg.model_copy(update={"service": cfg.service.model_copy(update={"instance": name})}), role
            ).start()
            for name, role in (("rollout-0", "rollout"), ("rollout-1", "rollout"), ("reward-0", "reward"))
        ]
        again = await Presence(
            js, cfg.model_copy(update={"service": cfg.service.model_copy(update={"instance": "reward-0"})}), "reward"
        ).start()
        # Read many times over: kv.keys() sometimes answered "no keys" here, making every replica look gone.
        for _ in range(40):
            entries = await read_presence(js, cfg.run_id, cfg.nats)
            assert [(e.instance, e.up) for e in entries] == [
                ("reward-0", True),
                ("rollout-0", True),
                ("rollout-1", True),
            ]
        assert {e.instance: e.restarts for e in entries}["reward-0"] == 1
        # Roles never seen: down, unless they may still be starting.
        assert roles_down(entries) == ["reference"] and roles_down(entries, count_unseen=False) == []
        for replica in (*replicas, again):
            await replica.stop()
        await nc.close()

    asyncio.run(scenario())


class MovingLoop:
    """A loop that always just moved, for the watchdog."""

    last_progress = time.time()

    def stalled_for(self, now: float) -> float:
        return 0.0


def test_each_replicas_loop_time_reaches_the_bucket_and_sums_into_its_roles_fractions(tiny_model, tmp_path, nats_url):
    cfg = run_config(tmp_path, tiny_model, run_id="shares", nats={"url": nats_url})
    spent = {
        "reward-0": {"busy": 3.0, "idle": 1.0, "blocked": 0.0},
        "reward-1": {"busy": 1.0, "idle": 2.0, "blocked": 1.0},
    }

    async def scenario():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await read_presence(js, cfg.run_id, cfg.nats)  # creates the bucket
        replicas, watchdogs = [], []
        for name, seconds in spent.items():
            named = cfg.model_copy(update={"service": cfg.service.model_copy(update={"instance": name})})
            presence = await Presence(js, named, "reward").start()
            replicas.append(presence)
            watchdogs.append(asyncio.create_task(watch_progress(MovingLoop(), [], presence, lambda s=seconds: s)))

        async def beaten() -> bool:  # the next beat carries what the watchdog put in the entry
            return {e.instance: e.time_s for e in await read_presence(js, cfg.run_id, cfg.nats)} == spent

        await until(beaten, 10 * HEARTBEAT_S, "each replica's time shares in its entry")
        entries = await read_presence(js, cfg.run_id, cfg.nats)
        assert role_time_shares(entries) == {"reward": {"busy": 0.5, "idle": 0.375, "blocked": 0.125}}
        for task in watchdogs:
            task.cancel()
        for replica in replicas:
            await replica.stop()
        await nc.close()

    asyncio.run(scenario())


def test_a_rollout_takes_the_trainer_port_from_a_trainer_entry_written_since_it_started_never_an_older_one(
    tiny_model, tmp_path, nats_url
):
    cfg = run_config(tmp_path, tiny_model, run_id="port", nats={"url": nats_url})

    async def scenario():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        since = time.time()
        waiting = asyncio.create_task(await_trainer_port(js, cfg.run_id, cfg.nats, since))
        # Fixed waits, since what they show is that nothing happens: with no bucket yet it waits for the trainer to
        # create one, and an entry older than its start does not end the wait.
        await asyncio.sleep(1.0)
        kv = await open_bucket(js, cfg.run_id, cfg.nats)
        dead = {"role": "trainer", "instance": "trainer", "grpc": "127.0.0.1:1111", "time": since - 30}
        await kv.put("trainer.trainer", json.dumps(dead).encode())  # a trainer that died before this start
        await asyncio.sleep(1.5)
        assert not waiting.done()
        trainer = await Presence(js, cfg, "trainer").start(grpc="127.0.0.1:4567")
        assert await asyncio.wait_for(waiting, 10) == 4567
        await trainer.stop()
        await nc.close()

    asyncio.run(scenario())


def test_an_entry_this_build_cannot_read_is_logged_by_key_and_left_out_and_a_newer_builds_fields_are_ignored(
    tiny_model, tmp_path, nats_url, caplog
):
    cfg = run_config(tmp_path, tiny_model, run_id="typed", nats={"url": nats_url})

    async def scenario():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        kv = await open_bucket(js, cfg.run_id, cfg.nats)
        now = time.time()
        newer = {"role": "reward", "instance": "reward-1", "time": now, "starts": 3, "gpu_util": 0.5}
        await kv.put("reward.reward-1", json.dumps(newer).encode())
        await kv.put("reward.reward-2", json.dumps({"role": "reward", "instance": "reward-2", "time": "now"}).encode())
        await kv.put("rollout.rollout-0", b"not json")
        # A replica restarting over the unreadable entry of its instance name starts counting again.
        named = cfg.model_copy(update={"service": cfg.service.model_copy(update={"instance": "rollout-0"})})
        rollout = await Presence(js, named, "rollout").start(grpc="127.0.0.1:1234")
        with pytest.raises(ValueError, match=r"no field\(s\) \['grcp'\]"):
            rollout.update(grcp="127.0.0.1:1")
        entries = await read_presence(js, cfg.run_id, cfg.nats)
        await rollout.stop()
        await nc.close()
        return entries

    caplog.set_level("WARNING")
    entries = asyncio.run(scenario())
    assert [(e.instance, e.up, e.restarts) for e in entries] == [("reward-1", True, 2), ("rollout-0", True, 1)]
    assert entries[1].grpc == "127.0.0.1:1234" and entries[1].pid > 0
    malformed = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "presence_malformed"]
    assert [m["key"] for m in malformed] == ["rollout.rollout-0", "reward.reward-2"]
    assert "time" in malformed[1]["error"]


def test_a_stopped_presence_beats_no_more_even_when_a_beat_dropped_its_cancellation(
    tiny_model, tmp_path, nats_url, monkeypatch
):
    """A beat is a KV put: on Python 3.11 a cancellation landing as its reply comes in is dropped. Stopped once
    and left so, the heartbeat would go on telling the run the replica is up after it stopped."""
    cfg = run_config(tmp_path, tiny_model, run_id="b", nats={"url": nats_url})
    monkeypatch.setattr(presence_module, "HEARTBEAT_S", 0.05)
    beats = []
    beat = Presence._beat

    async def beat_dropping_one_cancellation(self) -> None:
        await beat(self)
        beats.append(time.monotonic())
        if len(beats) == 3:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)  # stopped here: the cancellation is dropped, as wait_for drops it

    monkeypatch.setattr(Presence, "_beat", beat_dropping_one_cancellation)

    async def scenario():
        nc = await nats.connect(nats_url)
        presence = await Presence(nc.jetstream(), cfg, "trainer").start()  # the trainer creates the bucket
        while len(beats) < 3:
            await asyncio.sleep(0.05)
        await asyncio.wait_for(presence.stop(), timeout=10)
        stopped_at = len(beats)
        await asyncio.sleep(0.5)  # ten heartbeats' time
        assert len(beats) == stopped_at
        await nc.close()

    asyncio.run(scenario())


def test_a_replica_stopped_in_order_reads_as_stopped_a_silent_one_as_down_and_a_restart_as_up_again(
    tiny_model, tmp_path, nats_url, monkeypatch
):
    """A scale-in (KEDA, compose, `rlpipe scale`) ends replicas with SIGTERM: they are not failures, and `rlpipe
    status` and `rlpipe verify` must not call them down. One whose loop raised (its presence stopped, not in order)
    or that stops beating without a word (SIGKILL, a hang) is down."""
    cfg = run_config(tmp_path, tiny_model, run_id="stops", nats={"url": nats_url})
    monkeypatch.setattr(presence_module, "UP_WITHIN_S", 0.5)

    def named(instance: str):
        return cfg.model_copy(update={"service": cfg.service.model_copy(update={"instance": instance})})

    async def scenario():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await read_presence(js, cfg.run_id, cfg.nats)  # the trainer's read creates the bucket
        scaled_in = await Presence(js, named("rollout-1"), "rollout").start()
        crashed = await Presence(js, named("rollout-2"), "rollout").start()
        killed = await Presence(js, named("rollout-3"), "rollout").start()
        staying = await Presence(js, named("rollout-0"), "rollout").start()

        await scaled_in.stop(orderly=True)
        await crashed.stop()  # what serve_stage's finally does when the stage's loop raised
        killed._task.cancel()  # its process gone without a last word
        await asyncio.sleep(0.6)  # past UP_WITHIN_S
        await staying.announce()
        seen = {e.instance: (e.up, e.stopped) for e in await read_presence(js, cfg.run_id, cfg.nats)}
        assert seen == {
            "rollout-0": (True, False),
            "rollout-1": (False, True),
            "rollout-2": (False, False),
            "rollout-3": (False, False),
        }

        again = await Presence(js, named("rollout-1"), "rollout").start()  # started again under its name
        entry = next(e for e in await read_presence(js, cfg.run_id, cfg.nats) if e.instance == "rollout-1")
        assert (entry.up, entry.stopped, entry.restarts) == (True, False, 1)
        for replica in (again, staying):
            await replica.stop()
        await nc.close()

    asyncio.run(scenario())


@pytest.mark.unit
def test_gone_for_names_replicas_stopped_or_silent_past_the_retention_but_never_the_reader_nor_with_retention_0():
    def seen(instance: str, last_seen_s: float, up: bool) -> SeenService:
        return SeenService(role="rollout", instance=instance, time=0.0, last_seen_s=last_seen_s, up=up, restarts=0)

    entries = [
        seen("live", 1, True),
        seen("stopped-long-ago", 700, False),
        seen("silent-long-ago", 900, False),
        seen("stopped-lately", 30, False),
        seen("reader", 900, False),
    ]
    assert [e.instance for e in gone_for(entries, 600, spare="rollout.reader")] == [
        "stopped-long-ago",
        "silent-long-ago",
    ]
    assert gone_for(entries, 0, spare="rollout.reader") == []  # 0 keeps every entry for the whole run


@pytest.mark.unit
def test_an_instance_name_with_dots_keys_its_entry_under_its_own_role_and_never_holds_an_empty_token():
    """The broker grants a stage ``$KV.<bucket>.<role>.>``: the role must be the key's first token whatever the
    instance is named, and a key with an empty token (``a..b``) is no subject at all."""

    def named(instance: str) -> ServiceConfig:
        return ServiceConfig(instance=instance)

    instance = instance_name(named("trainer.x"), "rollout")
    assert key_role(presence_key("rollout", instance)) == "rollout"
    assert instance_name(named(".a..b*c."), "rollout") == "-.a.-.b-c.-"
    assert "" not in presence_key("rollout", instance_name(named("..."), "rollout")).split(".")
