"""Waiting out a dependency's outage, for a stage (services/common/transport/stage.py) and the messages it holds.

A step that raises ``DependencyUnavailable`` (a claim store away, a dead engine, a broker that fails a publish
or a settle) is tried again behind one ``CircuitBreaker`` for every dependency of the stage, with its backoff,
for as long as the dependency stays down: the messages in hand spend no delivery. The breaker's state is the
stage's ``rlpipe_stage_breaker_state`` gauge; each failure logs ``dependency_unavailable``, and an outage longer
than ``ack_wait_s * max_deliver`` (when naking would have dead-lettered healthy messages) logs the
``dependency_down`` alert once, ``dependency_recovered`` saying so when it ends. A dependency that refuses us
(``DependencyRefused``: a rejected or malformed token, TLS, DNS) is no passing outage: ``dependency_down`` (ERROR,
naming its ``kind``) comes at its first refusal, and ``refusal`` says what holds the stage until a try succeeds,
for its presence entry to carry to the trainer, which records it in the run's events (``dependency_refused``).
The wait counts as the loop blocked (``StageActivity.BLOCKED``) and as progress: a stage waiting out an outage is
at work, not stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from services.common.observe.events import Event
from services.common.observe.instruments import StageMetrics
from services.common.observe.logs import log_event
from services.common.observe.timeshare import StageActivity, TimeShare
from services.common.transport.breaker import (
    BreakerState,
    CircuitBreaker,
    DependencyRefused,
    DependencyUnavailable,
    Refusal,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoppedDuringOutage(Exception):
    """The stage was asked to stop while it waited for a dependency."""


@dataclass
class OutageGate:
    """``available(attempt)``: the attempt's result once its dependency answers, waited for behind the breaker."""

    metrics: StageMetrics
    time_share: TimeShare[StageActivity]
    alert_after_s: float  # ack_wait_s * max_deliver: when naking would have dead-lettered the messages held
    moved: Callable[[], None]  # the loop's progress, marked at each try
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    refusal: Refusal | None = field(init=False, default=None)  # a refusing dependency holds the stage, until a success
    _alerted: bool = field(init=False, default=False)  # the current outage has raised its alert
    _last_error: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.metrics.breaker(BreakerState.CLOSED)

    async def available(self, attempt: Callable[[], Awaitable[T]], step: str, stop: asyncio.Event) -> T:
        """``attempt()``'s result, retried behind the breaker for as long as it raises ``DependencyUnavailable``.

        Raises ``StoppedDuringOutage`` when ``stop`` is set while a dependency is down; with every dependency
        up, a stop lets the current batch finish as before.
        """
        while True:
            # Waits in short slices: the alert is due once the outage passes its bound, not at the next try.
            while (wait := self.breaker.retry_in()) > 0 and not stop.is_set():
                with self.time_share.during(StageActivity.BLOCKED), contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=min(wait, 1.0))
                self._maybe_alert(step)
            self.metrics.breaker(self.breaker.state)
            self.moved()
            if stop.is_set() and self.breaker.failures:
                raise StoppedDuringOutage
            try:
                result = await attempt()
            except DependencyUnavailable as error:
                self._failed(step, error)
                continue
            if self.breaker.failures:
                self._recovered(step)
            return result

    def _failed(self, step: str, error: DependencyUnavailable) -> None:
        self.breaker.failed()
        state = self.breaker.state
        self.metrics.breaker(state)
        self._last_error = repr(error)[:300]
        if isinstance(error, DependencyRefused):
            # Kept through the tries that follow (a breaker open on it sends nothing, so they cannot tell).
            self.refusal = Refusal(
                error.kind, step, self._last_error, self.refusal.since if self.refusal else time.time()
            )
        log_event(
            log,
            Event.DEPENDENCY_UNAVAILABLE,
            level=logging.WARNING,
            step=step,
            breaker=state.name.lower(),
            failures=self.breaker.failures,
            retry_s=round(self.breaker.retry_in(), 2),
            error=self._last_error,
        )
        self._maybe_alert(step)

    def _maybe_alert(self, step: str) -> None:
        if self._alerted or not self.breaker.failures:
            return
        if self.refusal is None and self.breaker.down_for() < self.alert_after_s:
            return  # a passing outage: naking would not have dead-lettered anything yet
        self._alerted = True
        refused = {"kind": self.refusal.kind, "refused": True} if self.refusal else {}
        log_event(
            log,
            Event.DEPENDENCY_DOWN,
            level=logging.ERROR,
            alert=True,
            step=step,
            down_s=round(self.breaker.down_for(), 1),
            error=self._last_error,
            **refused,
        )

    def _recovered(self, step: str) -> None:
        down_s = round(self.breaker.down_for(), 1)
        self.breaker.succeeded()
        self.refusal = None
        self.metrics.breaker(BreakerState.CLOSED)
        if self._alerted:
            self._alerted = False
            log_event(log, Event.DEPENDENCY_RECOVERED, step=step, down_s=down_s, alert=False)
        else:
            log_event(log, Event.DEPENDENCY_RECOVERED, step=step, down_s=down_s)
