"""Where a loop's wall time goes: seconds per activity, from the moments the loop switches between them.

A ``TimeShare`` is always in exactly one activity; ``enter`` closes the running interval and opens the next,
so the seconds per activity sum to the wall time since the share began (or since the last ``take``). The
stages count ``StageActivity`` (services/common/transport/stage.py), the trainer counts ``StepPhase`` per step
(services/trainer/service.py). The clock is injected so the accounting is tested without waiting.

Lanes. A stage may run several batches at once (``Stage.lanes``), each in a task of its own that says which
lane it is (``in_lane``); every ``enter`` then moves its own lane, and the share is in the activity that comes
first in ``precedence`` among the lanes' (a stage is busy while any lane computes, blocked while none computes
and one is held), so the seconds still sum to the wall time. Code that never names a lane is lane 0.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from enum import StrEnum
from typing import Generic, TypeVar

A = TypeVar("A", bound=StrEnum)
_LANE: ContextVar[int] = ContextVar("timeshare_lane", default=0)


def in_lane(lane: int) -> None:
    """The calling task (and the tasks it starts) count their activity as ``lane``."""
    _LANE.set(lane)


class StageActivity(StrEnum):
    """What a stage's loop is doing: working on a batch, waiting for input, or held by what is after it."""

    BUSY = "busy"  # decoding and computing
    IDLE = "idle"  # fetching: waiting for input
    BLOCKED = "blocked"  # publishing downstream, waiting for weights or for a dependency to come back


# With several lanes, a stage is busy while any lane is, else blocked while any lane is, else idle.
STAGE_PRECEDENCE = (StageActivity.BUSY, StageActivity.BLOCKED, StageActivity.IDLE)


class StepPhase(StrEnum):
    """Where the trainer's time between two step rows goes."""

    WAIT = "wait"  # collecting experience (feeding prompts, reading EXPERIENCE)
    COMPUTE = "compute"  # the learner's step
    PUBLISH = "publish"  # offering the new weights to the rollouts
    EVAL = "eval"  # held-out evaluation
    BOOKKEEPING = "bookkeeping"  # everything else: ledger, lineage, metrics, checkpoints, commands


class TimeShare(Generic[A]):
    """Seconds spent in each activity of ``A``; starts in ``initial`` at the clock's current time.

    ``precedence`` (default: the order ``A`` defines) decides the activity of a share whose lanes differ."""

    def __init__(self, initial: A, clock: Callable[[], float] = time.monotonic, precedence: Sequence[A] | None = None):
        self.clock = clock
        self.initial = initial
        self.precedence = tuple(precedence or type(initial))
        self._lanes: dict[int, A] = {0: initial}
        self._since = clock()
        self._seconds = dict.fromkeys(type(initial), 0.0)

    @property
    def current(self) -> A:
        """The share's activity: its lanes' first in ``precedence``."""
        return min(self._lanes.values(), key=self.precedence.index)

    def enter(self, activity: A) -> A:
        """Switch the calling task's lane to ``activity``; returns the one that lane was in."""
        self._close_interval()
        lane = _LANE.get()
        previous = self._lanes.get(lane, self.initial)
        self._lanes[lane] = activity
        return previous

    @contextlib.contextmanager
    def during(self, activity: A) -> Iterator[None]:
        """In ``activity`` for the block, then back in whatever came before it."""
        previous = self.enter(activity)
        try:
            yield
        finally:
            self.enter(previous)

    def seconds(self) -> dict[A, float]:
        """Seconds per activity so far, the running interval included."""
        totals = dict(self._seconds)
        totals[self.current] += self.clock() - self._since
        return totals

    def fractions(self) -> dict[A, float]:
        """Each activity's share of the time so far (they sum to 1); all 0 before any time has passed."""
        totals = self.seconds()
        wall = sum(totals.values())
        return {activity: (spent / wall if wall > 0 else 0.0) for activity, spent in totals.items()}

    def take(self) -> dict[A, float]:
        """Seconds per activity since the last ``take`` (or the start); the count then starts again from zero."""
        self._close_interval()
        taken, self._seconds = self._seconds, dict.fromkeys(self._seconds, 0.0)
        return taken

    def _close_interval(self) -> None:
        now = self.clock()
        self._seconds[self.current] += now - self._since
        self._since = now
