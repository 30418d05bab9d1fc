"""One HTTP service a role depends on (the remote reward, an HTTP environment): how its failed requests are judged,
retried and counted, and the circuit breaker that stops asking while it is down.

Every failed request is judged as one of three faults (``Verdict``):

- ``TRANSIENT``: the service is down or slow for now (no connection, no answer in time, HTTP 5xx, 408 or 429, an
  answer off its schema). Retried ``retries`` times, waiting ``backoff_s`` doubled each time; ``breaker_threshold``
  of them in a row open the breaker.
- ``PERSISTENT``: the service or rlpipe's configuration of it is wrong (a TLS or DNS failure, any status that
  blames neither the input nor a passing outage), and asking again now would meet the same answer: not retried,
  and the breaker opens at once.
- ``INPUT``: the service judged this input and refused it (400 or 422). Not retried and says nothing about the
  service being down: the breaker is left as it is, and the caller names the refusal in its own error.

``HttpDependency.call`` applies that policy to one request and records it: latency by outcome, errors by kind, the
breaker's state (``<prefix>_latency``, ``<prefix>_errors``, ``<prefix>_breaker_state``), a warning per failed
request, the ``down`` event (an alert) when the breaker opens and ``recovered`` at the first success after it. What
a failure means to the caller (a group held, an episode ended) is the caller's; so is reading the request's answer
into a ``Verdict`` where only its schema tells (``judge_error`` and ``fault_of_status`` decide the rest).

Redirects are never followed (``NO_REDIRECTS``, the opener both clients post through): urllib would follow a 301,
302 or 303 as a GET carrying the request's other headers (a bearer token among them) to whatever host the answer
names. A 3xx comes back as the ``HTTPError`` it is, and ``fault_of_status`` makes it persistent: the configured URL
is wrong, which asking again cannot fix.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from services.common.observe.events import Event
from services.common.observe.instruments import LATENCY_BUCKETS_S
from services.common.observe.logs import log_event
from services.common.observe.telemetry import meter
from services.common.transport.breaker import BreakerState, CircuitBreaker, DependencyUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT_STATUS = (408, 429)  # and every 5xx: the service is busy or down for now
INPUT_FAULT_STATUS = (400, 422)  # the only answers that blame the input
LOGGED_ERROR_CHARS = 300
# The breaker of every HTTP dependency (the remote reward, an HTTP environment): this many transient failures in a
# row open it, and while it is open one request is let through every BREAKER_COOLDOWN_S.
BREAKER_THRESHOLD = 3
BREAKER_COOLDOWN_S = 5.0


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx comes back as the HTTPError it is (see the module docstring for why none is followed)."""

    def redirect_request(self, *args: object) -> None:
        return None


NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


class Fault(Enum):
    """Whose failure a failed request is, and so whether asking again may help."""

    TRANSIENT = "transient"  # the service is down or slow for now: retried, then the caller waits
    PERSISTENT = "persistent"  # the service or its configuration is wrong: not retried now, the breaker opens
    INPUT = "input"  # the service refused this input: not retried, the breaker is untouched


@dataclass(frozen=True)
class Verdict:
    """A failed request judged: ``kind`` labels the error metric, ``reason`` says what happened."""

    fault: Fault
    kind: str
    reason: str


class RequestFailed(Exception):
    """One request (``attempts`` tries of it) failed as ``verdict`` says."""

    def __init__(self, verdict: Verdict, attempts: int = 1):
        super().__init__(verdict.reason)
        self.verdict = verdict
        self.attempts = attempts

    @property
    def kind(self) -> str:
        return self.verdict.kind

    @property
    def fault(self) -> Fault:
        return self.verdict.fault


def fault_of_status(status: int) -> Fault:
    """The fault an HTTP error status says a request met, by the status alone."""
    if status in INPUT_FAULT_STATUS:
        return Fault.INPUT
    if status >= 500 or status in TRANSIENT_STATUS:
        return Fault.TRANSIENT
    # 401/403: the token; 404/405: the URL; 3xx: a moved service; the rest (409, 413, 415, ...) the contract.
    return Fault.PERSISTENT


def judge_error(error: BaseException, url: str, timeout_s: float) -> Verdict:
    """The fault a request that got no HTTP answer met: no connection, no answer in time, TLS or DNS."""
    cause = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(cause, TimeoutError):  # socket.timeout is TimeoutError
        return Verdict(Fault.TRANSIENT, "timeout", f"no answer from {url} within {timeout_s:g}s")
    if isinstance(cause, ssl.SSLError):  # certificate checks included
        return Verdict(Fault.PERSISTENT, "tls", f"TLS with {url} failed: {cause!r}")
    if isinstance(cause, socket.gaierror):
        return Verdict(Fault.PERSISTENT, "dns", f"the host of {url} does not resolve: {cause!r}")
    # Refused, reset, cut off: nothing listens there yet (a restarting service refuses too) or it went away.
    return Verdict(Fault.TRANSIENT, "connection", f"{url}: {error!r}"[:LOGGED_ERROR_CHARS])


@dataclass(frozen=True)
class DependencyEvents:
    """The events one dependency logs: each failed request, the breaker opening (an alert), the first success after."""

    failed: Event
    down: Event
    recovered: Event

    def __post_init__(self) -> None:
        # Event names are a contract (tests/common/test_events.py): a free string would slip past its scan here.
        if not all(isinstance(event, Event) for event in (self.failed, self.down, self.recovered)):
            raise TypeError(f"DependencyEvents takes members of Event, got {self!r}")


class BreakerOpen(DependencyUnavailable):
    """The dependency is known to be down: nothing was sent."""


class HttpDependency:
    """The retry policy, breaker, metrics and events of one HTTP service at ``url``, shared by all its callers.

    ``what`` names the service in metric descriptions and errors ("the remote reward service"); ``metric_prefix``
    starts its metrics' names (``rlpipe_reward_http``). ``clock`` is the breaker's, for tests that skip its cool-down.
    """

    def __init__(
        self,
        url: str,
        what: str,
        metric_prefix: str,
        events: DependencyEvents,
        backoff_s: float,
        breaker_threshold: int = BREAKER_THRESHOLD,
        breaker_cooldown_s: float = BREAKER_COOLDOWN_S,
    ):
        self.url = url
        self.what = what
        self.events = events
        self.backoff_s = backoff_s
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown_s, backoff_s)
        self.down_logged = False
        m = meter()
        self.latency = m.create_histogram(
            f"{metric_prefix}_latency",
            unit="s",
            description=f"one request to {what}, by outcome",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.errors = m.create_counter(
            f"{metric_prefix}_errors", unit="{request}", description=f"failed requests to {what}, by kind"
        )
        self.breaker_gauge = m.create_gauge(
            f"{metric_prefix}_breaker_state", description=f"{what}'s breaker: 0 closed, 1 half-open, 2 open"
        )
        self.breaker_gauge.set(0)

    async def call(self, request: Callable[[], T], retries: int) -> T:
        """``request()``'s answer, run in a thread and retried as the module docstring says.

        ``request`` raises ``RequestFailed`` for a failure it judged. Raises ``BreakerOpen`` without calling it while
        the breaker is open, and otherwise the last ``RequestFailed`` (``attempts`` set) when no try answered.
        """
        if self.breaker.state == BreakerState.OPEN:
            raise BreakerOpen(f"{self.what} {self.url} is down (breaker open for {self.breaker.retry_in():.1f}s more)")
        for attempt in range(retries + 1):
            started = time.perf_counter()
            try:
                answer = await asyncio.to_thread(request)
            except RequestFailed as error:
                self.failed(error.verdict, time.perf_counter() - started)
                if error.fault != Fault.TRANSIENT or attempt == retries:
                    error.attempts = attempt + 1
                    raise
                await asyncio.sleep(self.backoff_s * 2**attempt)
                continue
            self.succeeded(time.perf_counter() - started)
            return answer
        raise AssertionError("unreachable: the last attempt returns or raises")

    def failed(self, verdict: Verdict, seconds: float) -> None:
        """Record one failed request (also one that never went out, such as an unreadable token)."""
        self.latency.record(seconds, {"outcome": "error"})
        self.errors.add(1, {"kind": verdict.kind})
        reason = verdict.reason[:LOGGED_ERROR_CHARS]
        log_event(log, self.events.failed, level=logging.WARNING, kind=verdict.kind, error=reason)
        if verdict.fault == Fault.INPUT:
            return  # the service is up and judged this input
        if verdict.fault == Fault.PERSISTENT:
            self.breaker.trip()  # asking again now would meet the same answer
        else:
            self.breaker.failed()
        self.breaker_gauge.set(int(self.breaker.state))
        if self.breaker.state != BreakerState.CLOSED and not self.down_logged:
            self.down_logged = True
            log_event(
                log,
                self.events.down,
                level=logging.ERROR,
                alert=True,
                url=self.url,
                kind=verdict.kind,
                failures=self.breaker.failures,
                error=reason,
            )

    def succeeded(self, seconds: float) -> None:
        self.latency.record(seconds, {"outcome": "ok"})
        if self.down_logged:
            self.down_logged = False
            log_event(log, self.events.recovered, url=self.url, down_s=round(self.breaker.down_for(), 1))
        self.breaker.succeeded()
        self.breaker_gauge.set(0)
