"""Dependency outages: the errors that say the message is fine but something it needs is down (or refuses us), and
the circuit breaker a stage (or a remote scorer, or the trainer's intake) retries behind while it is."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

# Dependency outages: first retry after BACKOFF_S, doubling up to the breaker's cool-down; BREAKER_THRESHOLD
# failures in a row open the breaker, which then lets one try through every BREAKER_COOLDOWN_S.
BACKOFF_S = 0.5
BREAKER_THRESHOLD = 3
BREAKER_COOLDOWN_S = 10.0


class DependencyUnavailable(Exception):
    """Something the stage depends on (object store, inference engine, broker) failed: the message is fine.

    A compute raises it (``raise DependencyUnavailable(...) from error``) for a failure that says
    nothing about its input; the stage then retries without spending the message's deliveries.
    """


class DependencyRefused(DependencyUnavailable):
    """The dependency answers, and refuses us: a rejected or malformed credential (401, 403, a token file that holds
    no sendable token), a TLS or DNS failure, a wrong URL. The message is still fine and is held like in any outage,
    but waiting will not end this one: it alerts at once instead of after ``ack_wait_s * max_deliver``.
    ``kind`` names the refusal (``http_401``, ``token``, ``tls``...); the message never quotes a credential."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True)
class Refusal:
    """What a stage is held on by a refusing dependency, as its presence entry carries it to the trainer."""

    kind: str  # the refusal's kind, as DependencyRefused names it
    step: str  # the stage's step it met it in (compute, claim_read, publish)
    error: str  # what was refused, bounded; never a credential
    since: float  # wall time of the first refusal of this outage


class BreakerState(IntEnum):
    """Also the value of the ``rlpipe_stage_breaker_state`` gauge."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Consecutive dependency failures open it; while open nothing is tried; after ``cooldown_s`` one try goes through.

    Closed: each failure waits ``backoff_s * 2**(failures - 1)`` (at most ``cooldown_s``) before the
    next try; ``threshold`` failures in a row open it. Open: tries wait out the cool-down, then the
    breaker is half-open and lets one through: a success closes it, a failure opens it again.
    ``clock`` (seconds, monotonic) is a parameter so the state machine can be tested without sleeping.
    """

    def __init__(
        self,
        threshold: int = BREAKER_THRESHOLD,
        cooldown_s: float = BREAKER_COOLDOWN_S,
        backoff_s: float = BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if threshold < 1 or cooldown_s <= 0 or backoff_s <= 0:
            raise ValueError("threshold must be >= 1 and cooldown_s, backoff_s > 0")
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.backoff_s = backoff_s
        self.clock = clock
        self.failures = 0  # consecutive, since the last success
        self.down_since: float | None = None  # clock at the first failure of the current streak
        self._last_failure = 0.0
        self._opened_at: float | None = None

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self.clock() - self._opened_at >= self.cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def retry_in(self) -> float:
        """Seconds until the next try may go through (0: now)."""
        now = self.clock()
        if self._opened_at is not None:
            return max(0.0, self._opened_at + self.cooldown_s - now)
        if self.failures == 0:
            return 0.0
        backoff = min(self.backoff_s * 2 ** (self.failures - 1), self.cooldown_s)
        return max(0.0, self._last_failure + backoff - now)

    def failed(self) -> None:
        now = self.clock()
        if self.failures == 0:
            self.down_since = now
        self.failures += 1
        self._last_failure = now
        # A failed half-open probe, or the threshold reached: (re)open for a full cool-down.
        if self._opened_at is not None or self.failures >= self.threshold:
            self._opened_at = now

    def trip(self) -> None:
        """A failure that retrying soon would only repeat (a refused token, a wrong URL): open now, below threshold."""
        self.failed()
        self._opened_at = self._last_failure

    def succeeded(self) -> None:
        self.failures = 0
        self.down_since = None
        self._opened_at = None

    def down_for(self) -> float:
        """Seconds since the current streak of failures began (0 when closed and healthy)."""
        return 0.0 if self.down_since is None else self.clock() - self.down_since
