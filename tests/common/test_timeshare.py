"""The accounting of a loop's wall time by activity, on a clock the test moves by hand."""

import asyncio

import pytest

from services.common.observe.timeshare import STAGE_PRECEDENCE, StageActivity, StepPhase, TimeShare, in_lane
from services.common.transport.presence import SeenService, role_time_shares

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_each_activity_gets_exactly_the_seconds_spent_in_it_and_the_fractions_sum_to_one():
    clock = FakeClock()
    share = TimeShare(StageActivity.IDLE, clock)
    clock.advance(3.0)  # waiting for input
    share.enter(StageActivity.BUSY)
    clock.advance(5.0)
    with share.during(StageActivity.BLOCKED):  # publishing
        clock.advance(2.0)
    assert share.current == StageActivity.BUSY  # back to computing after the publish
    clock.advance(2.0)  # still computing: the running interval counts before it closes
    assert share.seconds() == {StageActivity.IDLE: 3.0, StageActivity.BUSY: 7.0, StageActivity.BLOCKED: 2.0}
    fractions = share.fractions()
    assert fractions == {StageActivity.IDLE: 0.25, StageActivity.BUSY: 7 / 12, StageActivity.BLOCKED: 2 / 12}
    assert sum(fractions.values()) == pytest.approx(1.0)


def test_before_any_time_passes_every_fraction_is_zero():
    share = TimeShare(StageActivity.IDLE, FakeClock())
    assert share.fractions() == dict.fromkeys(StageActivity, 0.0)


def test_a_block_that_raises_still_returns_to_the_activity_before_it():
    clock = FakeClock()
    share = TimeShare(StageActivity.BUSY, clock)
    with pytest.raises(RuntimeError), share.during(StageActivity.BLOCKED):
        clock.advance(1.5)
        raise RuntimeError("the broker went away")
    clock.advance(1.0)
    assert share.seconds() == {StageActivity.IDLE: 0.0, StageActivity.BUSY: 1.0, StageActivity.BLOCKED: 1.5}


def test_each_take_covers_exactly_the_wall_time_since_the_last_and_starts_the_count_again():
    clock = FakeClock()
    steps = TimeShare(StepPhase.BOOKKEEPING, clock)
    with steps.during(StepPhase.EVAL):  # the step-0 evaluation delays the first step
        clock.advance(4.0)
    with steps.during(StepPhase.WAIT):
        clock.advance(1.0)
    with steps.during(StepPhase.COMPUTE):
        clock.advance(0.5)
    with steps.during(StepPhase.PUBLISH):
        clock.advance(0.25)
    clock.advance(0.125)  # assembling the row
    first = steps.take()
    assert first == {
        StepPhase.WAIT: 1.0,
        StepPhase.COMPUTE: 0.5,
        StepPhase.PUBLISH: 0.25,
        StepPhase.EVAL: 4.0,
        StepPhase.BOOKKEEPING: 0.125,
    }
    assert sum(first.values()) == clock.now - 100.0
    with steps.during(StepPhase.WAIT):
        clock.advance(2.0)
    second = steps.take()
    assert second == {**dict.fromkeys(StepPhase, 0.0), StepPhase.WAIT: 2.0}


def test_a_roles_fractions_are_taken_over_the_seconds_of_all_its_replicas():
    seen = {"time": 0.0, "last_seen_s": 0.0, "up": True, "restarts": 0}
    entries = [
        SeenService(role="reward", instance="reward-0", time_s={"busy": 3.0, "idle": 1.0, "blocked": 0.0}, **seen),
        SeenService(role="reward", instance="reward-1", time_s={"busy": 1.0, "idle": 3.0, "blocked": 0.0}, **seen),
        SeenService(role="rollout", instance="rollout-0", time_s={"busy": 6.0, "idle": 0.0, "blocked": 2.0}, **seen),
        SeenService(role="reference", instance="reference-0", **seen),  # still starting: no loop time yet
    ]
    assert role_time_shares(entries) == {
        "reward": {"busy": 0.5, "idle": 0.5, "blocked": 0.0},
        "rollout": {"busy": 0.75, "idle": 0.0, "blocked": 0.25},
    }


def test_with_lanes_the_share_is_busy_while_any_lane_computes_and_blocked_only_while_none_does():
    clock = FakeClock()
    share = TimeShare(StageActivity.IDLE, clock, precedence=STAGE_PRECEDENCE)

    async def lanes() -> None:
        first_computing, second_done = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            in_lane(0)
            share.enter(StageActivity.BUSY)
            first_computing.set()
            await second_done.wait()
            clock.advance(1.0)  # lane 0 computes alone
            share.enter(StageActivity.IDLE)

        async def second() -> None:
            in_lane(1)
            await first_computing.wait()
            with share.during(StageActivity.BLOCKED):  # publishing while lane 0 computes: the stage is busy
                clock.advance(2.0)
            assert share.current == StageActivity.BUSY
            second_done.set()

        await asyncio.gather(first(), second())
        assert share.current == StageActivity.IDLE  # both lanes idle
        with share.during(StageActivity.BLOCKED):  # lane 0 (this task) held, the other idle: blocked
            clock.advance(0.5)

    asyncio.run(lanes())
    assert share.seconds() == {StageActivity.BUSY: 3.0, StageActivity.IDLE: 0.0, StageActivity.BLOCKED: 0.5}
