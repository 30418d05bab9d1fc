"""The trainer's intake against a real nats-server: feeding, dead letters, repeats in EXPERIENCE."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import numpy as np
import pytest
from nats.js import api

from services.cli.dead_letters import reinject
from services.common.config import load_config
from services.common.model.datasets import load_jsonl
from services.common.transport.bus import Bus
from services.common.transport.messages import Episode, ExperienceGroup, Prompt, encode
from services.common.transport.reader import StreamReader
from services.common.transport.streams import (
    DEAD,
    EXPERIENCE,
    H_CLAIM,
    H_GROUP,
    H_INCARNATION,
    H_REASON,
    PROMPTS,
    stream_name,
    subject,
)
from services.trainer.checkpointing.state import TrainerState
from services.trainer.intake.feeder import PromptFeeder
from services.trainer.intake.ledger import Fate, GroupLedger
from services.trainer.intake.reader import Collected, Intake, without_signal
from services.trainer.progress import Progress
from tests.support.messages import completion, experience_group
from tests.support.runs import config_file

pytestmark = pytest.mark.integration


def config(tiny_model, tmp_path, nats_url, nats: dict | None = None, checkpoint: dict | None = None, **train):
    _, data_dir = tiny_model
    path = config_file(
        tmp_path,
        tiny_model,
        run_id="intake",
        nats={"url": nats_url, **(nats or {})},
        train={"batch_size": 2, "max_inflight_batches": 2, **train},
        **{"checkpoint": checkpoint} if checkpoint else {},
    )
    return load_config(path), load_jsonl(data_dir / "train.jsonl")


def experience(group_id: str, policy_version: int = 0, incarnation: str = "") -> ExperienceGroup:
    return experience_group(
        group_id,
        [1.0],
        completions=[completion([5, 2], 0.0, text="2")],
        prompt_ids=[5, 2],
        policy_version=policy_version,
        incarnation=incarnation,
    )


async def lost_nowhere(group_ids: list[str]) -> None:
    raise AssertionError(f"nothing may be written off here: {group_ids}")


VOCAB = 64  # the tiny model's vocabulary is larger; the ids these tests send are below 10


def intake_of(
    bus: Bus, rows: list, ledger: GroupLedger, progress: Progress, reopened: list[tuple[str, int]] | None = None
) -> Intake:
    """An intake feeding ``rows`` in order; re-injected groups it reopens are appended to ``reopened``."""

    async def record(group_id: str, dead_letter: int) -> None:
        if reopened is None:
            raise AssertionError(f"nothing may be reopened here: {group_id}")
        reopened.append((group_id, dead_letter))

    feeder = PromptFeeder(rows, 0, shuffle=False)
    return Intake(bus, feeder, ledger, progress, lost_nowhere, on_reopened=record, vocab_size=VOCAB)


def test_feeding_stops_at_the_in_flight_limit_and_skips_groups_that_already_have_a_fate(tiny_model, tmp_path, nats_url):
    cfg, rows = config(tiny_model, tmp_path, nats_url)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        ledger = GroupLedger()
        ledger.settle(["e0-i1"], step=0, fate=Fate.DEAD)  # dead-lettered before a restart
        intake = intake_of(bus, rows, ledger, Progress())
        await intake.feed(cfg.train, config_version=0)
        assert sorted(ledger.in_flight) == ["e0-i0", "e0-i2", "e0-i3", "e0-i4"]  # 2 batches of 2, e0-i1 skipped
        prompts = await bus.js.stream_info(stream_name(cfg.run_id, PROMPTS))
        assert prompts.state.messages == 4

        # A restarted trainer at the same cursor inside the duplicate window: the broker says duplicate, and
        # the group stays in flight (it is downstream) instead of being fed twice.
        again = intake_of(bus, rows, GroupLedger(), Progress())
        again.ledger.settle(["e0-i1"], step=0, fate=Fate.DEAD)
        await again.feed(cfg.train, config_version=0)
        assert sorted(again.ledger.in_flight) == ["e0-i0", "e0-i2", "e0-i3", "e0-i4"]
        assert (await bus.js.stream_info(stream_name(cfg.run_id, PROMPTS))).state.messages == 4
        await bus.close()

    asyncio.run(scenario())


def test_dead_letters_settle_their_groups_even_after_the_oldest_ones_expired(tiny_model, tmp_path, nats_url):
    cfg, rows = config(tiny_model, tmp_path, nats_url)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        for i in range(3):
            await bus.js.publish(
                f"rlpipe.{cfg.run_id}.dead", b"x", headers={"Rlpipe-Group-Id": f"e0-i{i}", "Nats-Msg-Id": f"d{i}"}
            )
        await bus.js.delete_msg(stream_name(cfg.run_id, DEAD), 1)  # aged out (nats.dead_letter_max_age_s)
        ledger = fed_ledger(3)
        intake = intake_of(bus, rows, ledger, Progress(step=5))
        assert await intake.catch_up_dead() == 2
        assert sorted(ledger.in_flight) == ["e0-i0"]
        assert {g: (s.step, s.fate) for g, s in ledger.settled.items()} == {
            "e0-i1": (5, Fate.DEAD),
            "e0-i2": (5, Fate.DEAD),
        }
        dead = await bus.js.stream_info(stream_name(cfg.run_id, DEAD))
        assert dead.config.max_age == cfg.nats.dead_letter_max_age_s
        await bus.close()

    asyncio.run(scenario())


def test_a_batch_takes_each_group_once_however_often_experience_holds_it(tiny_model, tmp_path, nats_url):
    cfg, rows = config(tiny_model, tmp_path, nats_url, max_staleness=1)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        ledger = GroupLedger()
        ledger.settle(["e9-i0"], step=3, fate=Fate.APPLIED)  # applied before the checkpoint
        progress = Progress(step=3, version=3)
        intake = intake_of(bus, rows, ledger, progress)
        # Two copies of e9-i1 (a re-feed past the duplicate window), one of the applied e9-i0, one stale group.
        for n, (group_id, version) in enumerate([("e9-i1", 3), ("e9-i0", 3), ("e9-i1", 3), ("e9-i2", 1), ("e9-i3", 2)]):
            await bus.publish(EXPERIENCE, experience(group_id, version), msg_id=f"copy-{n}")

        async def never() -> bool:
            return False

        collected = await intake.collect(cfg.train, 0, never, asyncio.Event())
        assert [g.group_id for g in collected.batch] == ["e9-i1", "e9-i3"]
        assert collected.dropped == ["e9-i2"]  # 3 - 1 > max_staleness 1
        assert collected.sequence == 5
        assert ledger.repeats == 2
        await bus.close()

    asyncio.run(scenario())


def test_a_trainer_that_started_over_feeds_the_same_ids_as_new_work_and_ignores_the_old_groups(
    tiny_model, tmp_path, nats_url
):
    """A restart without a checkpoint is a new incarnation: inside the duplicate window its prompts are not taken
    for repeats of the abandoned incarnation's, and the abandoned incarnation's groups are dropped unsettled, so
    they neither train the new policy nor block the same ids fed again."""
    cfg, rows = config(tiny_model, tmp_path, nats_url)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        first = intake_of(bus, rows, GroupLedger(), Progress(incarnation="a"))
        await first.feed(cfg.train, config_version=0)
        progress = Progress(incarnation="b")
        again = intake_of(bus, rows, GroupLedger(), progress)
        await again.feed(cfg.train, config_version=0)
        assert (await bus.js.stream_info(stream_name(cfg.run_id, PROMPTS))).state.messages == 8  # 4 + 4, none repeats

        await bus.publish(EXPERIENCE, experience("e0-i0", incarnation="a"), msg_id="old")
        await bus.publish(EXPERIENCE, experience("e0-i0", incarnation="b"), msg_id="new-0")
        await bus.publish(EXPERIENCE, experience("e0-i1", incarnation="b"), msg_id="new-1")

        async def never() -> bool:
            return False

        collected = await again.collect(cfg.train, 0, never, asyncio.Event())
        assert [(g.group_id, g.incarnation) for g in collected.batch] == [("e0-i0", "b"), ("e0-i1", "b")]
        assert collected.dropped == [] and again.ledger.repeats == 0
        await bus.close()

    asyncio.run(scenario())


async def never() -> bool:
    return False


def test_a_group_made_by_a_disowned_policy_version_is_dropped_on_arrival(tiny_model, tmp_path, nats_url):
    """A resume or rollback disowns the versions of the steps it abandons: their groups are dropped however fresh
    they are (the staleness bound is off here, so it cannot be what drops them), and the versions either side of
    the disowned range are still trained on."""
    cfg, rows = config(tiny_model, tmp_path, nats_url, max_staleness=None)
    assert cfg.train.max_staleness is None

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        progress = Progress(step=5, version=6, abandoned_versions=[(3, 4)])  # a resume from step 2 abandoned 3-4
        intake = intake_of(bus, rows, GroupLedger(), progress)
        for n, (group_id, version) in enumerate([("e9-i0", 3), ("e9-i1", 2), ("e9-i2", 4), ("e9-i3", 5)]):
            await bus.publish(EXPERIENCE, experience(group_id, version), msg_id=f"v-{n}")

        collected = await intake.collect(cfg.train, 0, never, asyncio.Event())
        assert [g.group_id for g in collected.batch] == ["e9-i1", "e9-i3"]  # versions 2 and 5
        assert collected.dropped == ["e9-i0", "e9-i2"]  # versions 3 and 4
        assert collected.sequence == 4
        await bus.close()

    asyncio.run(scenario())


def test_with_the_default_settings_a_group_nine_versions_old_is_dropped_and_one_eight_old_is_used(
    tiny_model, tmp_path, nats_url
):
    """The staleness bound holds without being configured: a rollout that cannot pull new weights keeps sampling
    from old ones, and only the trainer's default bound keeps those groups out of training."""
    cfg, rows = config(tiny_model, tmp_path, nats_url)  # train.max_staleness left to its default

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        progress = Progress(step=10, version=10)
        intake = intake_of(bus, rows, GroupLedger(), progress)
        for n, (group_id, version) in enumerate([("e9-i0", 1), ("e9-i1", 2), ("e9-i2", 10)]):
            await bus.publish(EXPERIENCE, experience(group_id, version), msg_id=f"s-{n}")

        collected = await intake.collect(cfg.train, 0, never, asyncio.Event())
        assert collected.dropped == ["e9-i0"]  # 10 - 1 = 9 versions old
        assert [g.group_id for g in collected.batch] == ["e9-i1", "e9-i2"]  # 8 versions old, and current
        await bus.close()

    asyncio.run(scenario())


async def publish_dead_letter(bus: Bus, group_id: str, n: int, incarnation: str | None) -> None:
    headers = {H_GROUP: group_id, "Nats-Msg-Id": f"d{n}"}
    if incarnation is not None:
        headers[H_INCARNATION] = incarnation
    await bus.js.publish(subject(bus.run_id, DEAD), b"x", headers=headers)


def test_a_hole_in_dead_is_stepped_over_and_only_this_incarnations_letters_settle_groups(
    tiny_model, tmp_path, nats_url
):
    """An operator may delete a dead letter: the trainer reads on past the hole instead of taking it for a broker
    that lost messages. A letter of an abandoned incarnation names a group id this one feeds as its own: it is
    ignored; a letter from before incarnations were stamped still settles its group."""
    cfg, rows = config(tiny_model, tmp_path, nats_url)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        for n, (group_id, incarnation) in enumerate([("e0-i0", "b"), ("e0-i1", "b"), ("e0-i2", "a"), ("e0-i3", None)]):
            await publish_dead_letter(bus, group_id, n, incarnation)
        await bus.js.delete_msg(stream_name(cfg.run_id, DEAD), 2)  # e0-i1's letter, between two others
        ledger = fed_ledger(4)
        progress = Progress(step=5, incarnation="b")
        intake = intake_of(bus, rows, ledger, progress)
        assert await intake.catch_up_dead() == 2
        assert {g: s.fate for g, s in ledger.settled.items()} == {"e0-i0": Fate.DEAD, "e0-i3": Fate.DEAD}
        assert sorted(ledger.in_flight) == ["e0-i1", "e0-i2"]
        assert progress.dead_seq == 4
        await bus.close()

    asyncio.run(scenario())


def experience_with_float_ids(group_id: str, incarnation: str) -> ExperienceGroup:
    group = experience(group_id, incarnation=incarnation)
    group.completions[0].token_ids = group.completions[0].token_ids.astype(np.float32)  # decodes, breaks the learner
    return group


def fed_ledger(count: int, now: float = 0.0) -> GroupLedger:
    """A ledger that has fed the groups e0-i0 .. e0-i{count-1} at ``now``."""
    ledger = GroupLedger()
    for i in range(count):
        ledger.fed(f"e0-i{i}", now=now)
    return ledger


async def publish_one_bad_then_two_good(bus: Bus) -> None:
    """Incarnation b's EXPERIENCE as the reference stage sends it: e0-i0 with float token ids, then e0-i1 and e0-i2."""
    await bus.publish(EXPERIENCE, experience_with_float_ids("e0-i0", "b"), msg_id="e0-i0.b.reference")
    for group_id in ("e0-i1", "e0-i2"):
        await bus.publish(EXPERIENCE, experience(group_id, incarnation="b"), msg_id=f"{group_id}.b.reference")


def checkpoint(ledger: GroupLedger, progress: Progress) -> TrainerState:
    """What a checkpoint of ``ledger`` and ``progress`` keeps of them (through its JSON form), as
    ``Recovery.snapshot`` takes it."""
    ledger.advance()
    return TrainerState.from_json(
        TrainerState(
            step=progress.step,
            policy_version=progress.version,
            last_experience_seq=progress.applied_seq,
            in_flight=ledger.unsettled(),
            incarnation=progress.incarnation,
            settled_through=ledger.watermark(),
            applied_ids=ledger.exceptions(),
            dead_ids=ledger.dead(),
            dead_seq=progress.dead_seq,
            reinjected=sorted(ledger.reinjected),
        ).to_json()
    )


def restarted(bus: Bus, rows: list, ledger: GroupLedger, progress: Progress, reopened: list) -> Intake:
    """The intake of a trainer resumed from a checkpoint of ``ledger`` and ``progress``."""
    return resumed_from(bus, rows, checkpoint(ledger, progress), reopened)


def resumed_from(bus: Bus, rows: list, state: TrainerState, reopened: list) -> Intake:
    resumed = GroupLedger()
    resumed.restore(
        state.in_flight,
        state.applied_ids,
        state.dead_ids,
        state.reinjected,
        state.step,
        now=time.monotonic(),
        settled_through=state.settled_through,
    )
    progress = Progress(
        step=state.step,
        version=state.policy_version,
        applied_seq=state.last_experience_seq,
        dead_seq=state.dead_seq,
        incarnation=state.incarnation,
    )
    return intake_of(bus, rows, resumed, progress, reopened)


def applied(intake: Intake, collected: Collected) -> list[str]:
    """What a train step does with a collected batch, as far as the intake is concerned."""
    intake.progress.step += 1
    intake.progress.applied_seq = collected.sequence
    group_ids = [g.group_id for g in collected.batch]
    intake.ledger.settle(group_ids, intake.progress.step, Fate.APPLIED)
    return group_ids


def test_a_dead_lettered_group_re_injected_while_the_trainer_is_down_is_applied_once_after_the_restart(
    tiny_model, tmp_path, nats_url
):
    """EXPERIENCE with float token ids goes to DEAD with the reason and the trainer's incarnation; the operator
    re-injects a fixed copy while the trainer is down; the restarted trainer reopens the group (its checkpoint
    kept it as dead) and applies the copy once. A later restart reads DEAD on after the record, and another copy
    of the group is refused as a repeat."""
    cfg, rows = config(tiny_model, tmp_path, nats_url)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        ledger = fed_ledger(4, now=time.monotonic())
        intake = intake_of(bus, rows, ledger, Progress(incarnation="b"))
        await publish_one_bad_then_two_good(bus)
        assert applied(intake, await intake.collect(cfg.train, 0, never, asyncio.Event())) == ["e0-i1", "e0-i2"]
        letter = await bus.js.get_msg(stream_name(cfg.run_id, DEAD), seq=1)
        assert letter.headers[H_GROUP] == "e0-i0" and letter.headers[H_INCARNATION] == "b"
        assert letter.headers[H_REASON] == "invalid ExperienceGroup: completion 0 token_ids are float32, not integers"
        assert ledger.fate("e0-i0") == Fate.DEAD

        # The trainer stops (its checkpoint is the state now); the operator sends a fixed copy back meanwhile.
        fixed = encode(experience("e0-i0", incarnation="b"))
        assert (await reinject(nats_url, cfg.run_id, 1, fixed)).origin == stream_name(cfg.run_id, EXPERIENCE)
        await bus.publish(EXPERIENCE, experience("e0-i3", incarnation="b"), msg_id="e0-i3.b.reference")
        reopened: list[tuple[str, int]] = []
        again = restarted(bus, rows, intake.ledger, intake.progress, reopened)
        assert again.ledger.fate("e0-i0") == Fate.DEAD
        await again.catch_up_dead()  # as the trainer does at start
        assert reopened == [("e0-i0", 1)] and "e0-i0" in again.ledger.in_flight
        assert applied(again, await again.collect(cfg.train, 0, never, asyncio.Event())) == ["e0-i0", "e0-i3"]

        # A second restart, after that step: the re-inject record is behind it, a further copy is a repeat.
        third = restarted(bus, rows, again.ledger, again.progress, reopened=[])
        # DEAD: the letter, the re-inject's record, the note that its copy went (read past: it names no group).
        assert third.progress.dead_seq == 3 and await third.catch_up_dead() == 0
        await bus.publish(EXPERIENCE, experience("e0-i0", incarnation="b"), msg_id="copy-again")
        for group_id in ("e0-i4", "e0-i5"):
            third.ledger.fed(group_id, now=time.monotonic())
            await bus.publish(EXPERIENCE, experience(group_id, incarnation="b"), msg_id=f"{group_id}.b.reference")
        assert applied(third, await third.collect(cfg.train, 0, never, asyncio.Event())) == ["e0-i4", "e0-i5"]
        assert third.ledger.repeats == 1
        assert third.ledger.watermark() == "e0-i3"  # the checkpoint keeps the applied e0-i0 under its watermark
        await bus.close()

    asyncio.run(scenario())


def test_dead_lettering_experience_waits_out_a_broker_that_refuses_the_write(tiny_model, tmp_path, nats_url):
    """DEAD refusing writes (full, here) is the broker's failure, not the message's: the trainer neither crashes
    nor skips the message, and dead-letters it once DEAD takes writes again."""
    cfg, rows = config(tiny_model, tmp_path, nats_url)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        await publish_dead_letter(bus, "older", 0, None)
        dead = stream_name(cfg.run_id, DEAD)
        settings = bus.stream_config(DEAD)
        await bus.js.update_stream(dataclasses.replace(settings, max_msgs=1, discard=api.DiscardPolicy.NEW))
        ledger = GroupLedger()
        intake = intake_of(bus, rows, ledger, Progress(incarnation="b"))
        await bus.publish(EXPERIENCE, experience_with_float_ids("e0-i0", "b"), msg_id="bad")
        for group_id in ("e0-i1", "e0-i2"):
            await bus.publish(EXPERIENCE, experience(group_id, incarnation="b"), msg_id=group_id)
        # Each try drops the partial batch (the loop goes on) and backs off; the message is not skipped.
        assert await intake.collect(cfg.train, 0, never, asyncio.Event()) is None
        assert intake.broker.failures == 1 and intake.broker.retry_in() > 0
        # The backoff's lapse is the condition: the intake tries again only after it.
        await asyncio.sleep(intake.broker.retry_in())
        assert await intake.collect(cfg.train, 0, never, asyncio.Event()) is None
        assert intake.broker.failures == 2 and ledger.fate("e0-i0") is None and intake.reader.next_seq == 1
        await bus.js.update_stream(settings)
        collected = None
        deadline = time.monotonic() + 30
        while collected is None and time.monotonic() < deadline:
            collected = await intake.collect(cfg.train, 0, never, asyncio.Event())
        assert [g.group_id for g in collected.batch] == ["e0-i1", "e0-i2"] and ledger.fate("e0-i0") == Fate.DEAD
        assert intake.broker.failures == 0
        assert (await bus.js.stream_info(dead)).state.messages == 2
        assert (await bus.js.get_msg(dead, seq=2)).headers[H_GROUP] == "e0-i0"
        await bus.close()

    asyncio.run(scenario())


def test_an_abandoned_incarnations_bad_experience_is_dead_lettered_without_settling_this_incarnations_group(
    tiny_model, tmp_path, nats_url
):
    cfg, rows = config(tiny_model, tmp_path, nats_url)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        ledger = GroupLedger()
        intake = intake_of(bus, rows, ledger, Progress(incarnation="b"))
        await bus.publish(EXPERIENCE, experience_with_float_ids("e0-i0", "a"), msg_id="old-bad")
        for group_id in ("e0-i0", "e0-i1"):
            await bus.publish(EXPERIENCE, experience(group_id, incarnation="b"), msg_id=group_id)
        collected = await asyncio.wait_for(intake.collect(cfg.train, 0, never, asyncio.Event()), timeout=30)
        assert [(g.group_id, g.incarnation) for g in collected.batch] == [("e0-i0", "b"), ("e0-i1", "b")]
        letter = await bus.js.get_msg(stream_name(cfg.run_id, DEAD), seq=1)
        assert (letter.headers[H_GROUP], letter.headers[H_INCARNATION]) == ("e0-i0", "a")
        assert ledger.dead() == [] and await intake.catch_up_dead() == 0
        await bus.close()

    asyncio.run(scenario())


def test_a_trainer_resumed_from_before_a_dead_letter_replays_it_and_still_applies_the_re_injected_copy_once(
    tiny_model, tmp_path, nats_url
):
    """The checkpoint predates the bad message: the resumed trainer reads the letter and the re-inject record from
    DEAD, then re-reads the bad message from EXPERIENCE and dead-letters it again (a duplicate inside the window; a
    new letter past it, sent by hand here). Neither settles the reopened group again: its copy is applied once."""
    cfg, rows = config(tiny_model, tmp_path, nats_url)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        ledger = fed_ledger(4, now=time.monotonic())
        intake = intake_of(bus, rows, ledger, Progress(incarnation="b"))
        saved = checkpoint(ledger, intake.progress)  # before anything was read
        await publish_one_bad_then_two_good(bus)
        assert applied(intake, await intake.collect(cfg.train, 0, never, asyncio.Event())) == ["e0-i1", "e0-i2"]
        assert await reinject(nats_url, cfg.run_id, 1, encode(experience("e0-i0", incarnation="b")))
        letter = await bus.js.get_msg(stream_name(cfg.run_id, DEAD), seq=1)
        late = {**letter.headers, "Nats-Msg-Id": "past-the-window"}  # the replay's letter, past the duplicate window
        await bus.js.publish(subject(cfg.run_id, DEAD), letter.data, headers=late)
        await bus.publish(EXPERIENCE, experience("e0-i3", incarnation="b"), msg_id="e0-i3.b.reference")

        reopened: list[tuple[str, int]] = []
        again = resumed_from(bus, rows, saved, reopened)
        first = applied(again, await asyncio.wait_for(again.collect(cfg.train, 0, never, asyncio.Event()), timeout=30))
        second = applied(again, await asyncio.wait_for(again.collect(cfg.train, 0, never, asyncio.Event()), timeout=30))
        assert (first, second) == (["e0-i1", "e0-i2"], ["e0-i0", "e0-i3"])
        assert reopened == [("e0-i0", 1)] and again.ledger.repeats == 0
        # The letter, the re-inject's record and note, the late letter: the replay's own letter was a duplicate.
        assert (await bus.js.stream_info(stream_name(cfg.run_id, DEAD))).state.messages == 4
        await bus.close()

    asyncio.run(scenario())


def test_a_late_copy_of_a_group_whose_fate_left_memory_is_refused_with_the_staleness_bound_off(
    tiny_model, tmp_path, nats_url
):
    """A stage cut off from NATS for longer than the duplicate window publishes its copy of an applied group at
    last. The fate of that group was dropped when the checkpoints that went back to it were pruned, and the
    staleness bound, which would have dropped so old a group, is off: the watermark alone refuses the copy, in
    the trainer that applied it and in one resumed from its checkpoint."""
    cfg, rows = config(tiny_model, tmp_path, nats_url, max_staleness=None)
    assert cfg.train.max_staleness is None

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        intake = intake_of(bus, rows, GroupLedger(), Progress(incarnation="a"))
        await intake.feed(cfg.train, config_version=0)
        for n, group_id in enumerate(["e0-i0", "e0-i1"]):
            await bus.publish(EXPERIENCE, experience(group_id, incarnation="a"), msg_id=f"first-{n}")
        assert applied(intake, await intake.collect(cfg.train, 0, never, asyncio.Event())) == ["e0-i0", "e0-i1"]
        saved = checkpoint(intake.ledger, intake.progress)
        assert saved.settled_through == "e0-i1" and saved.applied_ids == []  # the watermark stands for both
        intake.ledger.forget_through(intake.progress.step + 1)  # the checkpoints back to step 1 were pruned
        assert intake.ledger.fate("e0-i0") is None and intake.ledger.settled == {}

        intake.progress.version = 50  # many versions later: the copy is 50 versions stale, and nothing bounds it
        await bus.publish(EXPERIENCE, experience("e0-i0", incarnation="a"), msg_id="late-copy")
        for n, group_id in enumerate(["e0-i2", "e0-i3"]):
            await bus.publish(EXPERIENCE, experience(group_id, incarnation="a"), msg_id=f"second-{n}")
        assert applied(intake, await intake.collect(cfg.train, 0, never, asyncio.Event())) == ["e0-i2", "e0-i3"]
        assert intake.ledger.repeats == 1

        # Resumed from the step-1 checkpoint, the trainer reads the late copy again: its watermark refuses it.
        resumed = resumed_from(bus, rows, saved, reopened=[])
        resumed.feeder.seek(saved.data_cursor or {"epoch": 0, "index": 2})
        assert applied(resumed, await resumed.collect(cfg.train, 0, never, asyncio.Event())) == ["e0-i2", "e0-i3"]
        assert resumed.ledger.repeats == 1
        await bus.close()

    asyncio.run(scenario())


def rewarded(group_id: str, rewards: list[float], episode: Episode | None = None) -> ExperienceGroup:
    """A group of ``len(rewards)`` completions with those rewards (each ``episode``, if given)."""
    answer = completion([5, 2], 0.0, text="2", episode=episode)
    return experience_group(group_id, rewards, completions=[answer] * len(rewards), prompt_ids=[5, 2])


def test_dynamic_sampling_filters_equal_reward_groups_fills_the_batch_from_the_stream_and_settles_each_once(
    tiny_model, tmp_path, nats_url
):
    cfg, rows = config(tiny_model, tmp_path, nats_url, batch_size=2, dynamic_sampling=True)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        ledger = GroupLedger()
        intake = intake_of(bus, rows, ledger, Progress())
        await intake.feed(cfg.train, config_version=0)  # e0-i0..e0-i3 in flight
        # All wrong, all right, a signal, all right again, a signal, and one the next batch takes.
        sent = [[0, 0, 0], [1, 1, 1], [1, 0, 1], [1, 1, 1], [0, 1, 0], [0, 1, 1]]
        # The first one's episodes all failed in the environment: filtered, they still count in the agent metrics.
        failed = Episode(turns=1, tool_calls=1, tool_errors=1, env_seconds=0.1, outcome="env_error")
        for n, rewards in enumerate(sent):
            group = rewarded(f"e0-i{n}", rewards, episode=failed if n == 0 else None)
            await bus.publish(EXPERIENCE, group, msg_id=f"r-{n}")

        collected = await intake.collect(cfg.train, 0, never, asyncio.Event())
        assert [g.group_id for g in collected.batch] == ["e0-i2", "e0-i4"]  # full: batch_size 2
        assert collected.filtered == ["e0-i0", "e0-i1", "e0-i3"]
        assert [episode.outcome for episode in collected.filtered_episodes] == ["env_error"] * 3
        assert collected.dropped == [] and collected.sequence == 5
        assert collected.filtered_fraction == 3 / 5
        ledger.settle_collected(collected, step=1)
        assert {g: s.fate for g, s in ledger.settled.items()} == {
            "e0-i0": Fate.FILTERED,
            "e0-i1": Fate.FILTERED,
            "e0-i2": Fate.APPLIED,
            "e0-i3": Fate.FILTERED,
            "e0-i4": Fate.APPLIED,
        }
        assert ledger.counts == {Fate.APPLIED: 2, Fate.FILTERED: 3}  # none dead, none lost
        assert not ledger.read and "e0-i5" not in ledger.settled
        # A filtered group has its fate: a late copy of it is refused like any settled group's.
        await bus.publish(EXPERIENCE, rewarded("e0-i1", [1, 1, 1]), msg_id="late-copy")
        intake.progress.applied_seq = collected.sequence
        await bus.publish(EXPERIENCE, rewarded("e0-i6", [1, 0, 0]), msg_id="r-6")
        following = await intake.collect(cfg.train, 0, never, asyncio.Event())
        assert [g.group_id for g in following.batch] == ["e0-i5", "e0-i6"] and following.filtered == []
        assert ledger.repeats == 1
        await bus.close()

    asyncio.run(scenario())


@pytest.mark.unit
def test_a_group_of_one_completion_is_never_filtered_and_unequal_rewards_are_kept():
    assert without_signal(rewarded("g", [0.5, 0.5]))
    assert not without_signal(rewarded("g", [0.5]))
    assert not without_signal(rewarded("g", [0.5, 0.25]))


def test_synchronous_feeding_holds_one_batch_asks_for_the_current_version_and_refills_only_a_dropped_slot(
    tiny_model, tmp_path, nats_url
):
    cfg, rows = config(tiny_model, tmp_path, nats_url, synchronous=True)

    async def prompts_fed(bus: Bus) -> list[Prompt]:
        reader = StreamReader(bus, PROMPTS, 1)
        count = (await bus.js.stream_info(stream_name(cfg.run_id, PROMPTS))).state.messages
        return [await bus.decode(await reader.next(5), Prompt) for _ in range(count)]

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        ledger = GroupLedger()
        intake = intake_of(bus, rows, ledger, Progress(step=3, version=3))
        await intake.feed(cfg.train, config_version=0)
        first, second = sorted(ledger.in_flight)
        fed = await prompts_fed(bus)
        assert len(fed) == cfg.train.batch_size  # one batch, not max_inflight_batches of them
        assert [p.min_policy_version for p in fed] == [3, 3]  # made by the weights step 3 published

        # One group comes back made by version 2 (a rollout that had not synced): dropped, its slot fed again.
        await bus.publish(EXPERIENCE, experience(first, 3), msg_id="s-0")
        await bus.publish(EXPERIENCE, experience(second, 2), msg_id="s-1")
        collecting = asyncio.create_task(intake.collect(cfg.train, 0, never, asyncio.Event()))
        for _ in range(100):
            if len(await prompts_fed(bus)) == 3:
                break
            await asyncio.sleep(0.1)
        [refill] = [p for p in await prompts_fed(bus) if p.group_id not in (first, second)]
        assert refill.min_policy_version == 3
        await bus.publish(EXPERIENCE, experience(refill.group_id, 3), msg_id="s-2")
        collected = await asyncio.wait_for(collecting, 30)
        assert collected.dropped == [second]
        assert [g.group_id for g in collected.batch] == [first, refill.group_id]
        assert len(await prompts_fed(bus)) == 3  # nothing fed for the next step while this one is collected
        await bus.close()

    asyncio.run(scenario())


def test_a_prompt_the_broker_refuses_is_fed_again_and_the_watermark_waits_for_it_though_later_ones_landed(
    tiny_model, tmp_path, nats_url, caplog
):
    """A feed publishes its prompts together. The broker refuses the second (too large for the stream) and takes
    the others: they are in flight, the feeder goes back to the refused one, and the watermark stays below it
    when every group around it is settled, so the next feed publishes it and only it."""
    caplog.set_level(logging.DEBUG, logger="services.trainer.intake.reader")
    cfg, rows = config(tiny_model, tmp_path, nats_url)
    rows = [dict(row) for row in rows]
    rows[1]["prompt"] = "1+1=" * 500  # ~2 KB, over the stream's limit below

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        name = stream_name(cfg.run_id, PROMPTS)
        limits = (await bus.js.stream_info(name)).config
        await bus.js.update_stream(dataclasses.replace(limits, max_msg_size=1024))
        intake = intake_of(bus, rows, GroupLedger(), Progress())
        await intake.feed(cfg.train, config_version=0)
        assert sorted(intake.ledger.in_flight) == ["e0-i0", "e0-i2", "e0-i3"]
        assert (await bus.js.stream_info(name)).state.messages == 3
        assert intake.feeder.cursor == {"epoch": 0, "index": 1}
        await intake.feed(cfg.train, config_version=0)  # refused again: alerted once, not at every feed
        assert intake.feeder.cursor == {"epoch": 0, "index": 1}
        refusals = [r for r in caplog.records if r.getMessage() == "feed_refused"]
        assert [(r.levelno, r.fields.get("alert"), r.fields["group_id"]) for r in refusals] == [
            (logging.ERROR, True, "e0-i1"),
            (logging.DEBUG, None, "e0-i1"),
        ]
        assert "message size exceeds maximum allowed (err_code 10054)" in refusals[0].fields["error"]

        # Every group that landed comes back and settles before the refused one is fed again.
        intake.ledger.settle(["e0-i0", "e0-i2", "e0-i3"], step=1, fate=Fate.APPLIED)
        intake.ledger.advance()
        assert intake.ledger.watermark() == "e0-i0"  # not e0-i3: that would cover e0-i1, never fed
        assert not intake.ledger.known("e0-i1")

        await bus.js.update_stream(dataclasses.replace(limits, max_msg_size=-1))
        await intake.feed(cfg.train, config_version=0)
        assert sorted(intake.ledger.in_flight) == ["e0-i1", "e0-i4", "e0-i5", "e0-i6"]  # e0-i2, e0-i3 skipped
        assert intake.ledger.fed_count == 7
        assert (await bus.js.stream_info(name)).state.messages == 7
        await bus.close()

    asyncio.run(scenario())


def test_a_long_prompt_whose_claim_store_is_down_is_fed_again_once_it_is_back_while_the_others_go_on(
    tiny_model, tmp_path, nats_url, s3
):
    """A prompt past ``nats.claim_check_bytes`` travels by claim check: with the object store down its publish fails
    as an outage (not a crash of the trainer), the prompts around it are fed, and it is fed once the store is back."""
    cfg, rows = config(tiny_model, tmp_path, nats_url, nats={"claim_check_bytes": 512}, checkpoint=s3.checkpoint())
    rows = [dict(row) for row in rows]
    rows[1]["prompt"] = "1+1=" * 200  # ~800 bytes: claim-checked

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        intake = intake_of(bus, rows, GroupLedger(), Progress())
        s3.stop()
        await intake.feed(cfg.train, config_version=0)
        assert sorted(intake.ledger.in_flight) == ["e0-i0", "e0-i2", "e0-i3"]
        assert intake.feeder.cursor == {"epoch": 0, "index": 1}

        await asyncio.to_thread(s3.start)
        intake.ledger.settle(["e0-i0"], step=1, fate=Fate.APPLIED)
        await intake.feed(cfg.train, config_version=0)
        assert sorted(intake.ledger.in_flight) == ["e0-i1", "e0-i2", "e0-i3", "e0-i4"]
        later = [await bus.js.get_msg(stream_name(cfg.run_id, PROMPTS), seq=seq) for seq in (4, 5)]
        assert sorted(m.headers[H_GROUP] for m in later) == ["e0-i1", "e0-i4"]  # published together: either order
        [fed] = [m for m in later if m.headers[H_GROUP] == "e0-i1"]
        assert fed.headers[H_CLAIM] == "1"
        assert (await bus.decode(fed, Prompt)).prompt == rows[1]["prompt"]
        await bus.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_deterministic_batch_is_in_feeding_order_whatever_order_its_groups_arrive_in(
    tiny_model, tmp_path, nats_url, deterministic
):
    cfg, rows = config(tiny_model, tmp_path, nats_url, synchronous=True, deterministic=deterministic)

    async def scenario() -> list[str]:
        bus = await Bus(cfg, "trainer").connect()
        ledger = GroupLedger()
        ledger.settle([f"e0-i{i}" for i in range(9)], step=0, fate=Fate.APPLIED)  # so it feeds e0-i9 and e0-i10
        intake = intake_of(bus, rows, ledger, Progress())
        await intake.feed(cfg.train, config_version=0)
        assert sorted(ledger.in_flight) == ["e0-i10", "e0-i9"]
        # e0-i10 comes back first; a text sort would put it first too.
        await bus.publish(EXPERIENCE, experience("e0-i10"), msg_id="d-0")
        await bus.publish(EXPERIENCE, experience("e0-i9"), msg_id="d-1")
        collected = await asyncio.wait_for(intake.collect(cfg.train, 0, never, asyncio.Event()), 30)
        await bus.close()
        return [g.group_id for g in collected.batch]

    arrival = ["e0-i10", "e0-i9"]
    assert asyncio.run(scenario()) == (["e0-i9", "e0-i10"] if deterministic else arrival)


def test_an_overdue_group_a_stage_still_holds_or_has_yet_to_take_is_not_written_off_until_its_message_is_gone(
    tiny_model, tmp_path, nats_url
):
    """A long compute (within nats.max_work_s) or a queue a replica has not reached yet is no loss, however long the
    group has been in flight; a group with no message left anywhere is."""
    cfg, rows = config(tiny_model, tmp_path, nats_url, nats={"ack_wait_s": 1, "heartbeat_s": 0.5}, lost_after_s=6)

    async def scenario() -> None:
        trainer = await Bus(cfg, "trainer").connect()
        rollout = await Bus(cfg, "rollout").connect()
        written_off: list[str] = []

        async def record_lost(group_ids: list[str]) -> None:
            written_off.extend(group_ids)

        async def reopened_nowhere(group_id: str, dead_letter: int) -> None:
            raise AssertionError(f"nothing may be reopened here: {group_id}")

        ledger = GroupLedger()
        feeder = PromptFeeder(rows, 0, shuffle=False)
        intake = Intake(trainer, feeder, ledger, Progress(), record_lost, reopened_nowhere, VOCAB)
        await intake.feed(cfg.train, config_version=0)  # e0-i0 .. e0-i3 on PROMPTS
        [held] = await (await rollout.work_queue(PROMPTS)).fetch(1, timeout=5)  # a rollout works on e0-i0 at length
        long_ago = time.monotonic() - 60
        for group, flight in list(ledger.in_flight.items()):
            ledger.in_flight[group] = dataclasses.replace(flight, fed_at=long_ago)
        assert ledger.arrived("e0-i3")  # a later group came back: the three before it are overtaken and overdue
        assert sorted(ledger.overdue(time.monotonic(), cfg.train.lost_after_s)) == ["e0-i0", "e0-i1", "e0-i2"]

        assert await intake.write_off_overdue(cfg.train) == []
        await held.in_progress()
        # The broker lost PROMPTS (a wiped volume): no stage will ever bring those groups back.
        await trainer.js.purge_stream(stream_name(cfg.run_id, PROMPTS))
        intake.lost_checked = 0.0
        assert await intake.write_off_overdue(cfg.train) == ["e0-i0", "e0-i1", "e0-i2"]
        assert written_off == ["e0-i0", "e0-i1", "e0-i2"]
        await rollout.close()
        await trainer.close()

    asyncio.run(scenario())
