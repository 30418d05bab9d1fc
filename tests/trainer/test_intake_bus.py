"""The trainer's intake against a real nats-server: feeding, dead letters, repeats in EXPERIENCE."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.common.config import load_config
from services.common.model.datasets import load_jsonl
from services.common.transport.bus import DEAD, EXPERIENCE, PROMPTS, Bus, stream_name
from services.common.transport.messages import Completion, ExperienceGroup, Prompt, RolloutGroup, ScoredGroup, advance
from services.trainer.intake import Fate, GroupLedger, Intake, PromptFeeder
from services.trainer.progress import Progress
from tests.conftest import write_config

pytestmark = pytest.mark.integration


def config(tiny_model, tmp_path, nats_url, **train):
    model_dir, data_dir = tiny_model
    path = write_config(
        tmp_path / "c.yaml",
        model_dir,
        data_dir,
        tmp_path / "runs",
        run_id="intake",
        nats={"url": nats_url},
        train={"batch_size": 2, "max_inflight_batches": 2, **train},
    )
    return load_config(path), load_jsonl(data_dir / "train.jsonl")


def experience(group_id: str, policy_version: int = 0, incarnation: str = "") -> ExperienceGroup:
    prompt = Prompt(group_id=group_id, prompt_id=group_id, prompt="1+1=", answer="2", incarnation=incarnation)
    ids = np.asarray([5, 2], dtype=np.int32)
    completion = Completion(text="2", token_ids=ids, logprobs=np.zeros(2, np.float32), finish_reason="stop")
    rollout = advance(prompt, RolloutGroup, prompt_ids=ids, policy_version=policy_version, completions=[completion])
    scored = advance(rollout, ScoredGroup, rewards=np.ones(1, np.float32))
    return advance(scored, ExperienceGroup, ref_logprobs=[np.zeros(2, np.float32)])


async def lost_nowhere(group_ids: list[str]) -> None:
    raise AssertionError(f"nothing may be written off here: {group_ids}")


def test_feeding_stops_at_the_in_flight_limit_and_skips_groups_that_already_have_a_fate(tiny_model, tmp_path, nats_url):
    cfg, rows = config(tiny_model, tmp_path, nats_url)

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        ledger = GroupLedger()
        ledger.settle(["e0-i1"], step=0, fate=Fate.DEAD)  # dead-lettered before a restart
        intake = Intake(bus, PromptFeeder(rows, 0, shuffle=False), ledger, Progress(), lost_nowhere)
        await intake.feed(cfg, config_version=0)
        assert sorted(ledger.in_flight) == ["e0-i0", "e0-i2", "e0-i3", "e0-i4"]  # 2 batches of 2, e0-i1 skipped
        prompts = await bus.js.stream_info(stream_name(cfg.run_id, PROMPTS))
        assert prompts.state.messages == 4

        # A restarted trainer at the same cursor inside the duplicate window: the broker says duplicate, and
        # the group stays in flight (it is downstream) instead of being fed twice.
        again = Intake(bus, PromptFeeder(rows, 0, shuffle=False), GroupLedger(), Progress(), lost_nowhere)
        again.ledger.settle(["e0-i1"], step=0, fate=Fate.DEAD)
        await again.feed(cfg, config_version=0)
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
        ledger = GroupLedger()
        for i in range(3):
            ledger.fed(f"e0-i{i}", now=0.0)
        intake = Intake(bus, PromptFeeder(rows, 0, shuffle=False), ledger, Progress(step=5), lost_nowhere)
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
        intake = Intake(bus, PromptFeeder(rows, 0, shuffle=False), ledger, progress, lost_nowhere)
        # Two copies of e9-i1 (a re-feed past the duplicate window), one of the applied e9-i0, one stale group.
        for n, (group_id, version) in enumerate([("e9-i1", 3), ("e9-i0", 3), ("e9-i1", 3), ("e9-i2", 1), ("e9-i3", 2)]):
            await bus.publish(EXPERIENCE, experience(group_id, version), msg_id=f"copy-{n}")

        async def never() -> bool:
            return False

        collected = await intake.collect(cfg, 0, never, asyncio.Event())
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
        first = Intake(
            bus, PromptFeeder(rows, 0, shuffle=False), GroupLedger(), Progress(incarnation="a"), lost_nowhere
        )
        await first.feed(cfg, config_version=0)
        progress = Progress(incarnation="b")
        again = Intake(bus, PromptFeeder(rows, 0, shuffle=False), GroupLedger(), progress, lost_nowhere)
        await again.feed(cfg, config_version=0)
        assert (await bus.js.stream_info(stream_name(cfg.run_id, PROMPTS))).state.messages == 8  # 4 + 4, none repeats

        await bus.publish(EXPERIENCE, experience("e0-i0", incarnation="a"), msg_id="old")
        await bus.publish(EXPERIENCE, experience("e0-i0", incarnation="b"), msg_id="new-0")
        await bus.publish(EXPERIENCE, experience("e0-i1", incarnation="b"), msg_id="new-1")

        async def never() -> bool:
            return False

        collected = await again.collect(cfg, 0, never, asyncio.Event())
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
        intake = Intake(bus, PromptFeeder(rows, 0, shuffle=False), GroupLedger(), progress, lost_nowhere)
        for n, (group_id, version) in enumerate([("e9-i0", 3), ("e9-i1", 2), ("e9-i2", 4), ("e9-i3", 5)]):
            await bus.publish(EXPERIENCE, experience(group_id, version), msg_id=f"v-{n}")

        collected = await intake.collect(cfg, 0, never, asyncio.Event())
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
        intake = Intake(bus, PromptFeeder(rows, 0, shuffle=False), GroupLedger(), progress, lost_nowhere)
        for n, (group_id, version) in enumerate([("e9-i0", 1), ("e9-i1", 2), ("e9-i2", 10)]):
            await bus.publish(EXPERIENCE, experience(group_id, version), msg_id=f"s-{n}")

        collected = await intake.collect(cfg, 0, never, asyncio.Event())
        assert collected.dropped == ["e9-i0"]  # 10 - 1 = 9 versions old
        assert [g.group_id for g in collected.batch] == ["e9-i1", "e9-i2"]  # 8 versions old, and current
        await bus.close()

    asyncio.run(scenario())
