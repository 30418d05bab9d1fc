"""Broker state loss, consumer settings and dependency outages, against real nats-server (and moto for S3)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import shutil
import subprocess

import pytest
from nats.aio.subscription import Subscription
from nats.js import api

from services.common.config import RunConfig, load_config
from services.common.transport.breaker import BreakerState, DependencyUnavailable
from services.common.transport.bus import Bus, ConsumerSettingsConflict
from services.common.transport.messages import ClaimCheck, RolloutGroup, ScoredGroup, encode
from services.common.transport.reader import DIRECT_GET_HEADERS
from services.common.transport.stage import Stage
from services.common.transport.streams import (
    DEAD,
    EXPERIENCE,
    H_CLAIM,
    H_GROUP,
    ROLLOUTS,
    SCORED,
    WORK_QUEUES,
    BrokerStateLost,
    StreamGap,
    stream_name,
    subject,
)
from tests.support.bus import stream_messages, until_messages
from tests.support.messages import completion, rollout_group, scored
from tests.support.paths import BIN
from tests.support.runs import QUICK_REDELIVERY, run_config
from tests.support.servers import create_run_state, free_port, start_nats, wait_for_port

pytestmark = pytest.mark.integration


def config(tmp_path, tiny_model, name: str = "c.yaml", **sections) -> RunConfig:
    return run_config(tmp_path, tiny_model, name, run_id="faults", **sections)


def minimal_config(tmp_path, **nats) -> RunConfig:
    """A run config with files that exist but no model: a stage over claims needs neither a model nor data."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    return load_config(
        None,
        run_id="faults",
        runs_dir=str(tmp_path / "runs"),
        model={"path": str(tmp_path / "model")},
        data={"train_path": str(tmp_path / "train.jsonl")},
        nats=nats,
    )


def test_a_claim_with_a_bad_key_or_size_is_dead_lettered_with_the_reason_and_reads_nothing_outside(tmp_path, nats_url):
    """A claim pointing outside the store (absolute, or up with ..) at a body whose size and hash match would have
    been read and scored; an empty key read the store's root, failed as a store outage and held the stage forever."""
    cfg = minimal_config(
        tmp_path,
        url=nats_url,
        ack_wait_s=1,
        heartbeat_s=0.3,
        max_deliver=2,
        fetch_timeout_s=0.3,
        claim_check_bytes=512,
        max_claim_bytes=4096,
    )
    outside = tmp_path / "outside.msgpack"
    body = encode(rollout_group("planted"))
    outside.write_bytes(body)
    store_root = cfg.runs_dir.resolve()
    (store_root / "faults" / "claims" / "rollouts").mkdir(parents=True)  # as once the run has stored a claim
    sha256 = hashlib.sha256(body).hexdigest()
    claims = {
        "absolute": ClaimCheck(key=str(outside), size=len(body), sha256=sha256),
        "up": ClaimCheck(key="faults/claims/rollouts/../../../../outside.msgpack", size=len(body), sha256=sha256),
        "empty": ClaimCheck(key="", size=len(body), sha256=sha256),
        "huge": ClaimCheck(key="faults/claims/rollouts/huge", size=4097, sha256=sha256),
    }
    assert (store_root / claims["up"].key).resolve() == outside.resolve()  # the path the old join would read

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "reward").connect()
        for name, claim in claims.items():
            headers = {H_CLAIM: "1", "Nats-Msg-Id": f"{name}.rollout", "Rlpipe-Group-Id": name}
            await bus.js.publish(f"rlpipe.faults.{ROLLOUTS}", encode(claim), headers=headers)
        computed: list[str] = []

        async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
            computed.extend(g.group_id for g in groups)
            return [scored(g) for g in groups]

        stop = asyncio.Event()
        stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 4, "reward")
        task = asyncio.create_task(stage.run(stop))
        await until_messages(bus, DEAD, len(claims))
        stop.set()
        await task
        assert computed == [] and await stream_messages(bus, SCORED) == 0
        assert stage.outage.breaker.failures == 0  # a bad key is the message's fault, never a store outage
        reasons = {}
        for seq in range(1, len(claims) + 1):
            letter = await bus.js.get_msg(stream_name("faults", DEAD), seq=seq)
            reasons[letter.headers["Rlpipe-Group-Id"]] = letter.headers["Rlpipe-Reason"]
        assert reasons.keys() == claims.keys()
        assert "not under the run's claim prefix 'faults/claims/'" in reasons["absolute"]
        assert "not a plain path" in reasons["up"]
        assert "not under the run's claim prefix" in reasons["empty"]
        assert "declares 4097 bytes; allowed 1 to nats.max_claim_bytes=4096" in reasons["huge"]
        await bus.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------ consumer settings


def test_changed_consumer_settings_reach_the_broker(tiny_model, tmp_path, nats_url):
    old = config(tmp_path, tiny_model, "old.yaml", nats={"url": nats_url, "max_deliver": 3, "ack_wait_s": 30})
    new = config(
        tmp_path,
        tiny_model,
        "new.yaml",
        nats={"url": nats_url, "max_deliver": 6, "ack_wait_s": 45, "max_ack_pending": 7, "duplicate_window_s": 600},
    )
    durable, stream = WORK_QUEUES[ROLLOUTS], stream_name("faults", ROLLOUTS)

    async def scenario() -> None:
        await create_run_state(old)
        bus = await Bus(old, "reward").connect()
        await bus.work_queue(ROLLOUTS)
        info = await bus.js.consumer_info(stream, durable)
        assert (info.config.max_deliver, info.config.ack_wait) == (4, 30.0)  # one more than max_deliver, see work_queue
        await bus.close()

        bus = await Bus(new, "reward").connect()  # a restart with raised limits
        await bus.work_queue(ROLLOUTS)
        info = await bus.js.consumer_info(stream, durable)
        assert (info.config.max_deliver, info.config.ack_wait, info.config.max_ack_pending) == (7, 45.0, 7)

        # A difference JetStream cannot update (someone made the durable replaying at the original pace) stops start-up.
        await bus.js.delete_consumer(stream, durable)
        await bus.js.add_consumer(stream, bus.consumer_config(ROLLOUTS).evolve(replay_policy=api.ReplayPolicy.ORIGINAL))
        with pytest.raises(ConsumerSettingsConflict, match="replay_policy: 'original' on the broker, 'instant' wanted"):
            await bus.work_queue(ROLLOUTS)
        await bus.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------ lost broker state


async def to_experience(bus: Bus, numbers: range) -> None:
    """Groups g<n> on EXPERIENCE, as the reference publishes them."""
    for n in numbers:
        await bus.publish(EXPERIENCE, rollout_group(f"g{n}"), msg_id=f"g{n}.reference")


def test_a_reader_stops_at_a_gap_instead_of_skipping_it(tiny_model, tmp_path, nats_url):
    cfg = config(tmp_path, tiny_model, nats={"url": nats_url})

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        await to_experience(bus, range(2))
        reader = bus.read_from(EXPERIENCE, 1)
        assert [(await reader.next(2)).sequence for _ in range(2)] == [1, 2]
        await to_experience(bus, range(2, 5))  # after the reader's last read-ahead: it holds none of them
        await bus.js.delete_msg(stream_name("faults", EXPERIENCE), 3)  # the message the reader needs next is gone
        with pytest.raises(StreamGap) as gap:
            await reader.next(2)
        assert (gap.value.stream, gap.value.expected, gap.value.found) == (stream_name("faults", EXPERIENCE), 3, 4)
        assert "sequences 3..3 were lost" in str(gap.value)
        assert isinstance(gap.value, BrokerStateLost)
        with pytest.raises(StreamGap):  # it stays where it was: no later call skips the gap either
            await reader.next(2)
        # A reader whose read-ahead spans the hole hands out what comes before it, then stops at it.
        fresh = bus.read_from(EXPERIENCE, 1)
        assert [(await fresh.next(2)).sequence for _ in range(2)] == [1, 2]
        with pytest.raises(StreamGap, match=r"sequences 3\.\.3 were lost"):
            await fresh.next(2)
        # A checkpoint that read up to 2 needs 3 next: check_covers says the same before any read.
        with pytest.raises(StreamGap, match="expected sequence 3"):
            await bus.js.purge_stream(stream_name("faults", EXPERIENCE), seq=4)  # first_seq is now 4
            await bus.check_covers(EXPERIENCE, 2)
        await bus.check_covers(EXPERIENCE, 3)  # a trainer past 3 purged below itself: fine
        with pytest.raises(BrokerStateLost, match="ends at sequence 5 but sequence 9 was already read"):
            await bus.check_covers(EXPERIENCE, 9)
        # The trainer purges everything it checkpointed: an empty stream still covers its sequence.
        await bus.js.purge_stream(stream_name("faults", EXPERIENCE), seq=6)
        await bus.check_covers(EXPERIENCE, 5)
        await bus.close()

    asyncio.run(scenario())


def test_a_reader_reads_ahead_in_one_request_and_hands_out_each_message_with_its_own_headers(
    tiny_model, tmp_path, nats_url
):
    cfg = config(tmp_path, tiny_model, nats={"url": nats_url})

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        await to_experience(bus, range(5))
        reader = bus.read_from(EXPERIENCE, 1)
        first = await reader.next(2)
        # The four after it came with the first in one batched direct get: gone from the broker, still handed out.
        for sequence in range(2, 6):
            await bus.js.delete_msg(stream_name("faults", EXPERIENCE), sequence)
        rest = [await reader.next(2) for _ in range(4)]
        assert [m.sequence for m in [first, *rest]] == [1, 2, 3, 4, 5]
        assert [m.headers[H_GROUP] for m in [first, *rest]] == [f"g{i}" for i in range(5)]
        assert [m.headers["Nats-Msg-Id"] for m in [first, *rest]] == [f"g{i}.reference" for i in range(5)]
        assert not any(key in m.headers for m in [first, *rest] for key in DIRECT_GET_HEADERS)  # the broker's own
        assert [(await bus.decode(m, RolloutGroup)).group_id for m in rest] == ["g1", "g2", "g3", "g4"]
        assert reader.next_seq == 6 and await reader.next(0.2) is None
        await bus.close()

    asyncio.run(scenario())


def test_a_reply_lost_on_the_way_is_asked_for_again_neither_taken_for_a_hole_nor_stepped_over(
    tiny_model, tmp_path, nats_url, monkeypatch
):
    """A reply the broker sent and the reader never got (a reconnect mid-batch) is no hole in the stream: the
    first of an EXPERIENCE batch lost must not stop the trainer with StreamGap, and one lost inside a DEAD batch
    must not be skipped as if aged out (its group's fate would be lost). Each reply names the one before it."""
    cfg = config(tmp_path, tiny_model, nats={"url": nats_url})
    lost = {stream_name("faults", EXPERIENCE): {1}, stream_name("faults", DEAD): {3}}
    receive = Subscription.next_msg

    async def losing_replies(self, timeout=1.0):
        while True:
            reply = await receive(self, timeout)
            headers = reply.headers or {}
            to_lose = lost.get(headers.get("Nats-Stream"), set())
            if int(headers.get("Nats-Sequence", 0)) not in to_lose:
                return reply
            to_lose.remove(int(headers["Nats-Sequence"]))  # lost once: the broker's next answer carries it

    monkeypatch.setattr(Subscription, "next_msg", losing_replies)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        await to_experience(bus, range(4))
        for letter in range(5):
            await bus.js.publish(subject("faults", DEAD), b"letter", headers={"letter": str(letter)})
        experience = bus.read_from(EXPERIENCE, 1)
        assert [(await experience.next(2)).sequence for _ in range(4)] == [1, 2, 3, 4]
        dead = bus.read_from(DEAD, 1)
        letters = [await dead.next(2) for _ in range(5)]
        assert [(m.sequence, m.headers["letter"]) for m in letters] == [(i + 1, str(i)) for i in range(5)]
        assert lost == {stream_name("faults", EXPERIENCE): set(), stream_name("faults", DEAD): set()}
        await bus.close()

    asyncio.run(scenario())


def test_a_batch_read_across_a_reconnect_is_handed_out_only_once_the_stream_is_checked(
    tiny_model, tmp_path, nats_url, monkeypatch
):
    """The connection came back while a batch was read, and the stream with it was re-created empty: the batch
    (the lost stream's messages) is not handed out; the check that follows every reconnect stops the reader."""
    cfg = config(tmp_path, tiny_model, nats={"url": nats_url})
    receive = Subscription.next_msg
    name = stream_name("faults", EXPERIENCE)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()

        async def reconnecting_mid_batch(self, timeout=1.0):
            reply = await receive(self, timeout)
            if (reply.headers or {}).get("Nats-Sequence") == "1":
                kept = (await bus.js.stream_info(name)).config
                await bus.js.delete_stream(name)
                await bus.js.add_stream(kept)
                bus.nc.stats["reconnects"] += 1  # as nats-py counts a reconnect, before replies come over it
            return reply

        await to_experience(bus, range(3))
        reader = bus.read_from(EXPERIENCE, 1)
        monkeypatch.setattr(Subscription, "next_msg", reconnecting_mid_batch)
        with pytest.raises(BrokerStateLost, match="was re-created"):
            await reader.next(2)
        assert reader.next_seq == 1 and reader.buffered == 0
        await bus.close()

    asyncio.run(scenario())


def test_a_broker_back_without_its_store_gets_its_streams_and_consumers_back_and_readers_stop(tiny_model, tmp_path):
    port, store = free_port(), tmp_path / "nats"
    server, url = start_nats(store, port)
    cfg = config(tmp_path, tiny_model, nats={"url": url})

    async def scenario() -> subprocess.Popen:
        bus = await Bus(cfg, "trainer").connect()
        reconnected = asyncio.Event()

        async def listener() -> None:
            reconnected.set()

        bus.on_reconnect(listener)
        await bus.work_queue(ROLLOUTS)
        for i in range(3):
            await bus.publish(EXPERIENCE, rollout_group(f"g{i}"), msg_id=f"g{i}.reference")
        reader = bus.read_from(EXPERIENCE, 1)
        assert [(await reader.next(2)).sequence for _ in range(3)] == [1, 2, 3]
        created = await bus.stream_created(EXPERIENCE)
        await bus.check_covers(EXPERIENCE, 3, created)

        server.kill()  # power loss, and the broker's volume with it
        server.wait()
        shutil.rmtree(store)
        restarted, _ = start_nats(store, port)
        await asyncio.wait_for(reconnected.wait(), timeout=20)
        # Every stream and the work queue's consumer are back, empty.
        for edge in (EXPERIENCE, ROLLOUTS, DEAD):
            assert await stream_messages(bus, edge) == 0
        assert (await bus.js.consumer_info(stream_name("faults", ROLLOUTS), WORK_QUEUES[ROLLOUTS])).config.max_deliver
        with pytest.raises(BrokerStateLost, match="ends at sequence 0 but sequence 3 was already read"):
            await bus.check_covers(EXPERIENCE, 3)
        with pytest.raises(BrokerStateLost, match="sequence 3 was already read"):
            await reader.next(2)
        # Refilled past the reader's position, the re-created stream would hand out other groups under the
        # sequences expected; the creation time tells them apart.
        for i in range(5):
            await bus.publish(EXPERIENCE, rollout_group(f"new{i}"), msg_id=f"new{i}.reference")
        with pytest.raises(BrokerStateLost, match="was re-created"):
            await reader.next(2)
        with pytest.raises(BrokerStateLost, match="was re-created"):
            await bus.check_covers(EXPERIENCE, 3, created)
        await bus.close()
        return restarted

    restarted = asyncio.run(scenario())
    restarted.terminate()
    restarted.wait(timeout=10)


def test_a_stage_finding_a_broker_back_without_its_store_waits_for_the_trainer_to_restore_the_streams(
    tiny_model, tmp_path, caplog
):
    """The trainer stopped (as it does on broker_state_lost) and the broker lost its store: a stage's bus does not
    re-create the streams, it waits for them, and once the trainer has restored them its consumer is back."""
    port, store = free_port(), tmp_path / "nats"
    server, url = start_nats(store, port)
    cfg = config(tmp_path, tiny_model, nats={"url": url})
    caplog.set_level(logging.INFO)

    def waiting() -> list[str]:
        return [r.fields["what"] for r in caplog.records if r.getMessage() == "waiting_for_trainer"]

    async def scenario() -> subprocess.Popen:
        await create_run_state(cfg)
        stage = await Bus(cfg, "reward").connect()
        restored = asyncio.Event()

        async def listener() -> None:
            restored.set()

        stage.on_reconnect(listener)
        await stage.work_queue(ROLLOUTS)
        server.kill()
        server.wait()
        shutil.rmtree(store)
        restarted, _ = start_nats(store, port)
        for _ in range(200):
            if waiting():
                break
            await asyncio.sleep(0.1)
        assert waiting() == [f"stream {stream_name('faults', 'prompts')}"]
        # A fixed wait, since what it shows is that nothing happens: the stage keeps looking and creates nothing.
        await asyncio.sleep(1.0)
        assert not restored.is_set()
        assert (await stage.js.streams_info()) == []
        trainer = await Bus(cfg, "trainer").connect()  # back: it restores the streams
        await asyncio.wait_for(restored.wait(), timeout=20)
        assert (await trainer.js.consumer_info(stream_name("faults", ROLLOUTS), WORK_QUEUES[ROLLOUTS])).config
        for bus in (stage, trainer):
            await bus.close()
        return restarted

    restarted = asyncio.run(scenario())
    restarted.terminate()
    restarted.wait(timeout=10)
    assert [r.fields["what"] for r in caplog.records if r.getMessage() == "trainer_state_found"] == [
        f"stream {stream_name('faults', 'prompts')}"
    ]


# ------------------------------------------------------------------ dependency outages


def test_an_engine_outage_longer_than_the_delivery_budget_dead_letters_nothing(tiny_model, tmp_path, nats_url, caplog):
    cfg = config(
        tmp_path,
        tiny_model,
        nats={"url": nats_url, **QUICK_REDELIVERY},
    )
    outage_s = 3 * cfg.nats.ack_wait_s * cfg.nats.max_deliver  # the old rule dead-lettered within ack_wait*max_deliver
    ids = [f"g{i}" for i in range(5)]
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "reward").connect()
        for group_id in ids:
            await bus.publish(ROLLOUTS, rollout_group(group_id), msg_id=f"{group_id}.rollout")
        loop = asyncio.get_running_loop()
        back_at = loop.time() + outage_s
        computed: list[str] = []

        async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
            if loop.time() < back_at:
                raise DependencyUnavailable("engine down")
            computed.extend(g.group_id for g in groups)
            return [scored(g) for g in groups]

        stop = asyncio.Event()
        stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 2, "reward")
        task = asyncio.create_task(stage.run(stop))
        # A fixed wait into the outage: what is checked is the state at that moment, not an event to wait for.
        await asyncio.sleep(outage_s * 0.8)
        # Mid-outage: the breaker is open, the stage holds one batch and fetches nothing more; the rest waits
        # in the stream undelivered, and nothing was redelivered.
        assert stage.outage.breaker.state is not BreakerState.CLOSED
        consumer = await bus.js.consumer_info(stream_name("faults", ROLLOUTS), WORK_QUEUES[ROLLOUTS])
        assert (consumer.num_ack_pending, consumer.num_pending, consumer.num_redelivered) == (2, 3, 0)
        while await stream_messages(bus, SCORED) < len(ids):
            assert loop.time() < back_at + 30, "the stage did not recover"
            await asyncio.sleep(0.1)
        stop.set()
        await task
        assert sorted(computed) == ids  # each exactly once
        assert await stream_messages(bus, SCORED) == len(ids) and await stream_messages(bus, DEAD) == 0
        assert stage.handled == len(ids) and stage.outage.breaker.state is BreakerState.CLOSED
        await bus.close()

    asyncio.run(scenario())
    events = [getattr(r, "fields", {}) | {"event": r.getMessage()} for r in caplog.records]
    assert [e for e in events if e["event"] == "dependency_down" and e.get("alert") is True]
    assert [e for e in events if e["event"] == "dependency_recovered" and e.get("alert") is False]
    assert not [e for e in events if e["event"] in ("dead_letter", "compute_failed")]


def test_a_bad_message_still_goes_to_dead_letters(tiny_model, tmp_path, nats_url):
    cfg = config(
        tmp_path,
        tiny_model,
        nats={"url": nats_url, **QUICK_REDELIVERY},
    )

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "reward").connect()
        for group_id in ("good", "bad"):
            await bus.publish(ROLLOUTS, rollout_group(group_id), msg_id=f"{group_id}.rollout")

        async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
            if any(g.group_id == "bad" for g in groups):
                raise ValueError("no answer can be scored")  # the data's fault, not a dependency's
            return [scored(g) for g in groups]

        stop = asyncio.Event()
        task = asyncio.create_task(Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 2, "reward").run(stop))
        await until_messages(bus, DEAD, 1, timeout=20)
        stop.set()
        await task
        assert await stream_messages(bus, SCORED) == 1 and await stream_messages(bus, DEAD) == 1
        letter = await bus.js.get_msg(stream_name("faults", DEAD), seq=1)
        assert (
            "no answer can be scored" in letter.headers["Rlpipe-Reason"] and letter.headers["Rlpipe-Group-Id"] == "bad"
        )
        await bus.close()

    asyncio.run(scenario())


def test_a_claim_store_outage_while_storing_bodies_holds_the_messages(tiny_model, tmp_path, nats_url, monkeypatch):
    monkeypatch.setenv("RLPIPE_S3_ACCESS_KEY", "testing")
    monkeypatch.setenv("RLPIPE_S3_SECRET_KEY", "testing")
    s3_port = free_port()  # nothing listens on it until the store "comes back"
    nats = {"url": nats_url, **QUICK_REDELIVERY}
    checkpoint = {"store_url": "s3://claims/x", "s3_endpoint": f"127.0.0.1:{s3_port}", "s3_secure": False}
    producer = config(tmp_path, tiny_model, "p.yaml", nats=nats)  # its groups are small enough to travel inline
    stage_cfg = config(
        tmp_path,
        tiny_model,
        "s.yaml",
        nats={**nats, "claim_check_bytes": 512, "max_message_bytes": 4096},
        checkpoint=checkpoint,
    )
    ids = [f"g{i}" for i in range(3)]
    moto: list[subprocess.Popen] = []

    async def scenario() -> None:
        await create_run_state(producer)
        source = await Bus(producer, "rollout").connect()
        for group_id in ids:
            # ~2 KB: inline for the producer, past the stage's claim_check_bytes, so every output's body
            # goes to the (unreachable) store.
            await source.publish(ROLLOUTS, rollout_group(group_id, [completion(200)]), msg_id=f"{group_id}.rollout")
        bus = await Bus(stage_cfg, "reward").connect()

        async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
            return [scored(g) for g in groups]

        stop = asyncio.Event()
        stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 1, "reward")
        task = asyncio.create_task(stage.run(stop))
        # A fixed wait past the whole redelivery budget, since what it shows is that nothing happens: no crash.
        await asyncio.sleep(3 * stage_cfg.nats.ack_wait_s * stage_cfg.nats.max_deliver)
        assert not task.done(), "the stage crashed on the store outage"
        assert stage.outage.breaker.failures > 0 and await stream_messages(bus, SCORED) == 0
        moto.append(
            subprocess.Popen(
                [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(s3_port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        await asyncio.to_thread(wait_for_port, s3_port, moto[0], "moto_server")
        await until_messages(bus, SCORED, len(ids), timeout=60)
        stop.set()
        await task
        assert await stream_messages(bus, SCORED) == len(ids) and await stream_messages(bus, DEAD) == 0
        assert stage.handled == len(ids)
        for seq in range(1, len(ids) + 1):
            out = await bus.js.get_msg(stream_name("faults", SCORED), seq=seq)
            assert out.headers[H_CLAIM] == "1"
            assert len((await bus.decode(out, ScoredGroup)).completions[0].token_ids) == 200
        await bus.close()
        await source.close()

    try:
        asyncio.run(scenario())
    finally:
        for process in moto:
            process.terminate()
            process.wait(timeout=10)


def test_a_broker_refusing_a_dead_letter_holds_the_message_instead_of_crashing_the_stage(
    tiny_model, tmp_path, nats_url
):
    """Dead-lettering is a broker call like the downstream publish: while DEAD refuses writes (full, here) the stage
    keeps the bad message, backs off behind its breaker and stays up; once DEAD takes writes the letter lands."""
    cfg = config(
        tmp_path,
        tiny_model,
        nats={"url": nats_url, **QUICK_REDELIVERY, "max_deliver": 1},
    )

    async def scenario() -> None:
        await create_run_state(cfg)
        owner = await Bus(cfg, "trainer").connect()
        await owner.js.publish(f"rlpipe.{cfg.run_id}.dead", b"older", headers={"Nats-Msg-Id": "older"})
        settings = owner.stream_config(DEAD)
        await owner.js.update_stream(dataclasses.replace(settings, max_msgs=1, discard=api.DiscardPolicy.NEW))
        bus = await Bus(cfg, "reward").connect()
        await bus.publish(ROLLOUTS, rollout_group("bad"), msg_id="bad.rollout")

        async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
            raise ValueError("no answer can be scored")

        stop = asyncio.Event()
        stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 1, "reward")
        task = asyncio.create_task(stage.run(stop))
        # A fixed wait past several ack waits, since what it shows is that nothing happens: no crash.
        await asyncio.sleep(4 * cfg.nats.ack_wait_s)
        assert not task.done(), "the stage crashed on a dead letter the broker refused"
        assert stage.outage.breaker.failures > 0 and await stream_messages(bus, DEAD) == 1
        await owner.js.update_stream(settings)
        await until_messages(bus, DEAD, 2)
        stop.set()
        await task
        assert await stream_messages(bus, DEAD) == 2 and await stream_messages(bus, ROLLOUTS) == 0
        letter = await bus.js.get_msg(stream_name("faults", DEAD), seq=2)
        assert letter.headers["Rlpipe-Group-Id"] == "bad"
        assert "no answer can be scored" in letter.headers["Rlpipe-Reason"]
        await bus.close()
        await owner.close()

    asyncio.run(scenario())


def test_closing_ends_every_restore_even_one_that_drops_cancellations(tmp_path, monkeypatch):
    """A stage's restore waits while the trainer has not re-created the streams; stopped then, the service closes
    its bus. A restore that dropped its cancellation (Python 3.11's wait_for under nats-py) held that close, and
    the service's exit, up for as long as the streams stayed away; a superseded restore was never awaited at all."""
    cfg = minimal_config(tmp_path)
    ended: list[str] = []

    async def waiting_for_the_streams(bus: Bus) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # dropped once, as wait_for does when a reply lands
            await asyncio.sleep(3600)
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("restore")

    monkeypatch.setattr(Bus, "_restore_state", waiting_for_the_streams)

    async def scenario() -> None:
        bus = Bus(cfg, "reward")
        await bus._reconnected()
        await asyncio.sleep(0)
        await bus._reconnected()  # a second reconnect supersedes the first restore
        await asyncio.sleep(0)
        await asyncio.wait_for(bus.close(), timeout=10)
        assert ended == ["restore", "restore"]  # both over when close returns, not left to asyncio.run's clean-up

    asyncio.run(scenario())
