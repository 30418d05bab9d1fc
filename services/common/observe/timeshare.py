"""Where a loop's wall time goes: seconds per activity, from the moments the loop switches between them.

A ``TimeShare`` is always in exactly one activity; ``enter`` closes the running interval and opens the next,
so the seconds per activity sum to the wall time since the share began (or since the last ``take``). The
stages count ``StageActivity`` (services/common/transport/stage.py), the trainer counts ``StepPhase`` per step
(services/trainer/service.py). The clock is injected so the accounting is tested without waiting.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Generic, TypeVar

A = TypeVar("A", bound=StrEnum)


class StageActivity(StrEnum):
    """What a stage's loop is doing: working on a batch, waiting for input, or held by what is after it."""

    BUSY = "busy"  # decoding and computing
    IDLE = "idle"  # fetching: waiting for input
    BLOCKED = "blocked"  # publishing downstream, waiting for weights or for a dependency to come back


class StepPhase(StrEnum):
    """Where the trainer's time between two step rows goes."""

    WAIT = "wait"  # collecting experience (feeding prompts, reading EXPERIENCE)
    COMPUTE = "compute"  # the learner's step
    PUBLISH = "publish"  # offering the new weights to the rollouts
    EVAL = "eval"  # held-out evaluation
    BOOKKEEPING = "bookkeeping"  # everything else: ledger, lineage, metrics, checkpoints, commands


class TimeShare(Generic[A]):
    """Seconds spent in each activity of ``A``; starts in ``initial`` at the clock's current time."""

    def __init__(self, initial: A, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.current = initial
        self._since = clock()
        self._seconds = dict.fromkeys(type(initial), 0.0)

    def enter(self, activity: A) -> A:
        """Switch to ``activity``; returns the one it was in."""
        now = self.clock()
        self._seconds[self.current] += now - self._since
        previous, self.current, self._since = self.current, activity, now
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
        self.enter(self.current)
        taken, self._seconds = self._seconds, dict.fromkeys(self._seconds, 0.0)
        return taken
