"""A real stage's loop against a real broker: where its wall time goes (busy, idle, blocked)."""

import asyncio
import contextlib
import time

import pytest
from nats.js.errors import NotFoundError

from services.common.config import RunConfig
from services.common.observe.timeshare import StageActivity
from services.common.transport.bus import Bus
from services.common.transport.messages import RolloutGroup, ScoredGroup
from services.common.transport.stage import Stage
from services.common.transport.streams import ROLLOUTS, SCORED, stream_name
from tests.support.bus import running
from tests.support.messages import completion, rollout_group, scored
from tests.support.runs import run_config
from tests.support.servers import create_run_state
from tests.support.waits import until

pytestmark = pytest.mark.integration

COMPUTE_S = 0.4


def rollout(group_id: str) -> RolloutGroup:
    return rollout_group(group_id, [completion()] * 2)


def stage_config(tiny_model, tmp_path, nats_url: str, run_id: str) -> RunConfig:
    return run_config(tmp_path, tiny_model, run_id=run_id, nats={"url": nats_url, "fetch_timeout_s": 0.2})


def test_a_stage_without_input_is_idle_and_its_compute_counts_as_busy_and_its_fractions_sum_to_one(
    tiny_model, tmp_path, nats_url
):
    cfg = stage_config(tiny_model, tmp_path, nats_url, "timeshare")

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "reward").connect()

        async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
            await asyncio.sleep(COMPUTE_S)
            return [scored(g) for g in groups]

        stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 1, "reward")
        started = time.monotonic()
        stop = asyncio.Event()
        loop = asyncio.create_task(stage.run(stop))
        # The wait is what is measured, so it is a fixed one: with nothing to do, all of it must count as idle.
        await asyncio.sleep(1.5)
        quiet = stage.time_share.seconds()
        assert quiet[StageActivity.BUSY] == 0.0 and quiet[StageActivity.BLOCKED] == 0.0
        assert stage.time_share.fractions()[StageActivity.IDLE] == 1.0

        for name in ("a", "b"):
            await bus.publish(ROLLOUTS, rollout(name), msg_id=f"{name}.rollout")
        await until(lambda: stage.handled == 2, 10, "both groups handled")
        stop.set()
        await loop
        wall = time.monotonic() - started
        spent = stage.time_share.seconds()
        assert stage.handled == 2
        assert spent[StageActivity.BUSY] >= 2 * COMPUTE_S  # each compute is busy time, never idle
        assert spent[StageActivity.BLOCKED] > 0  # each publish waited for the broker's ack
        assert sum(spent.values()) == pytest.approx(wall, abs=0.05)  # no second of the loop unaccounted for
        assert sum(stage.time_share.fractions().values()) == pytest.approx(1.0)
        assert spent[StageActivity.IDLE] > spent[StageActivity.BUSY]  # mostly waiting: idle dominates
        await bus.close()

    asyncio.run(scenario())


def test_a_stage_with_two_lanes_computes_a_second_batch_while_the_first_is_still_in_hand(
    tiny_model, tmp_path, nats_url
):
    cfg = stage_config(tiny_model, tmp_path, nats_url, "lanes")

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "reward").connect()
        other_done = asyncio.Event()
        finished: list[str] = []

        async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
            [group] = groups
            if group.group_id == "a":  # held until the other batch is through: one lane alone would wait for ever
                await asyncio.wait_for(other_done.wait(), timeout=20)
            else:
                other_done.set()
            finished.append(group.group_id)
            return [scored(group)]

        stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 1, "reward", lanes=2)
        async with running(stage):
            await bus.publish(ROLLOUTS, rollout("a"), msg_id="a.rollout")
            await asyncio.sleep(0.5)  # a is in one lane's hands before b is published
            await bus.publish(ROLLOUTS, rollout("b"), msg_id="b.rollout")
            await until(lambda: stage.handled == 2, 10, "both groups handled")
        assert finished == ["b", "a"]
        assert stage.handled == 2
        assert sum(stage.time_share.fractions().values()) == pytest.approx(1.0)
        await bus.close()

    asyncio.run(scenario())


def test_a_batch_fetched_after_the_stop_was_asked_for_is_handed_back_at_once_not_computed(
    tiny_model, tmp_path, nats_url
):
    # A long fetch, so the stop comes while the lane waits in it, and an ack wait far longer than the test.
    nats = {"url": nats_url, "fetch_timeout_s": 10, "ack_wait_s": 60, "heartbeat_s": 5}
    cfg = run_config(tmp_path, tiny_model, run_id="handback", nats=nats)

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "reward").connect()
        computed: list[str] = []

        async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
            computed.extend(g.group_id for g in groups)
            return [scored(g) for g in groups]

        stop = asyncio.Event()
        loop = asyncio.create_task(Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 1, "reward").run(stop))
        rollouts = stream_name(cfg.run_id, ROLLOUTS)

        async def waiting_in_fetch() -> bool:
            with contextlib.suppress(NotFoundError):
                return (await bus.js.consumer_info(rollouts, "reward")).num_waiting > 0
            return False

        await until(waiting_in_fetch, 10, "the lane waiting in its fetch")
        stop.set()  # SIGTERM: a scale-in
        await bus.publish(ROLLOUTS, rollout("late"), msg_id="late.rollout")
        await asyncio.wait_for(loop, 15)
        assert computed == []
        # Back in the queue now, for another replica: its second delivery, long before the ack wait would give it.
        other = await Bus(cfg, "reward").connect()
        [again] = await (await other.work_queue(ROLLOUTS)).fetch(1, timeout=5)
        assert again.metadata.num_delivered == 2
        await other.close()
        await bus.close()

    asyncio.run(scenario())
