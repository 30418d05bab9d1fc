"""A remote reward service: batched JSON POSTs of (prompt, completion, answer, metadata) -> one score each.

The request and response schema is in docs/rewards.md; ``services.reward.reference_server`` serves it.

Failure policy. Every failed request is judged (``judge_status``, ``judge_error``: pure, no socket)
as one of three faults:

- ``TRANSIENT``: the service is down or slow for now (no connection, past ``timeout_s``, HTTP 5xx,
  408 or 429, an answer off the schema). Retried ``retries`` times, waiting ``backoff_s`` doubled
  each time.
- ``PERSISTENT``: the service or rlpipe's configuration of it is wrong, and asking again now will
  not help (401, 403, 404, 405 and any other status that does not blame the input, a redirect, a
  TLS or DNS failure, an answer over ``max_response_bytes``, an unreadable ``token_file``). Not
  retried: the breaker opens at once and ``reward_service_down`` names the status.
- ``INPUT``: the service blames this input (400 or 422 with ``{"error": reason}``):
  ``RemoteRewardRejected``, which the stage retries and dead-letters like any failing compute.

Every transient or persistent failure feeds a ``CircuitBreaker``: ``BREAKER_THRESHOLD`` transient
ones in a row, or one persistent one, open it, and while it is open no request is sent. When a batch
cannot be scored the scorer raises ``DependencyUnavailable``: the stage holds the groups (no
delivery spent, nothing dead-lettered, nothing scored 0) and tries again behind its own breaker.
The breaker opening logs ``reward_service_down`` (an alert) and its closing
``reward_service_recovered``; latency, errors and the breaker's state are metrics
(``rlpipe_reward_http_*``).

Redirects are not followed: a POST cannot be replayed safely as the GET that 301/302/303 turn it
into, and following one would send the bearer token to whatever host the answer names. A moved
service is a configuration to fix (``reward.http.url``), so a redirect is a persistent fault naming
its ``Location``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import math
import socket
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from services.common.config import RewardHttpConfig
from services.common.observe.events import Event
from services.common.observe.instruments import LATENCY_BUCKETS_S
from services.common.observe.logs import log_event
from services.common.observe.telemetry import meter
from services.common.transport.breaker import BreakerState, CircuitBreaker, DependencyUnavailable

log = logging.getLogger(__name__)

BREAKER_THRESHOLD = 3  # transient failures in a row that open the breaker
BREAKER_COOLDOWN_S = 5.0  # while open, one request is let through this often
TRANSIENT_STATUS = (408, 429)  # and every 5xx: the service is busy or down for now
INPUT_FAULT_STATUS = (400, 422)  # with a reason, the only answers that blame the input
ERROR_BODY_BYTES = 4096  # of a failed answer's body, enough for its reason


@dataclass(frozen=True)
class RemoteItem:
    """One completion to score, as it goes on the wire."""

    prompt: str
    completion: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


class Fault(Enum):
    """Whose failure a failed request is, and so what happens to the groups it scores."""

    TRANSIENT = "transient"  # the service is down or slow for now: retried, then the groups wait
    PERSISTENT = "persistent"  # the service or its configuration is wrong: not retried now, the groups wait
    INPUT = "input"  # the service blames this input: the stage retries the groups, then dead-letters them


@dataclass(frozen=True)
class Verdict:
    """A failed request judged: ``kind`` labels the error metric, ``reason`` says what happened."""

    fault: Fault
    kind: str
    reason: str


class RemoteRewardRejected(RuntimeError):
    """The reward service refused the request as bad input (HTTP 400 or 422 with a reason)."""


class _RequestFailed(Exception):
    """One request failed in a way that says nothing about its input."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.reason)
        self.verdict = verdict

    @property
    def kind(self) -> str:
        return self.verdict.kind


def _stated_reason(body: bytes) -> str:
    """The ``error`` of a ``{"error": reason}`` body (docs/rewards.md), "" when the body states none."""
    try:
        stated = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    return stated.strip() if isinstance(stated, str) else ""


def judge_status(status: int, body: bytes, url: str, location: str = "") -> Verdict:
    """The fault an HTTP error status (3xx, 4xx, 5xx) says a request met; ``body`` is its (bounded) answer."""
    kind, detail = f"http_{status}", f"HTTP {status} from {url}: {body[:300]!r}"
    if status in INPUT_FAULT_STATUS:
        reason = _stated_reason(body)
        if reason:
            return Verdict(Fault.INPUT, kind, f"HTTP {status} from {url}: {reason[:300]}")
        # Not the schema's refusal: a proxy or another service at this URL, which would refuse every input.
        return Verdict(Fault.PERSISTENT, kind, f"{detail} gives no reason (no JSON error field): is {url} the service?")
    if status >= 500 or status in TRANSIENT_STATUS:
        return Verdict(Fault.TRANSIENT, kind, detail)
    if 300 <= status < 400:
        return Verdict(
            Fault.PERSISTENT,
            kind,
            f"HTTP {status} from {url} redirects to {location!r}, which is not followed: "
            "set reward.http.url to the service's address",
        )
    # 401/403: the token; 404/405: the URL; the rest (409, 413, 415, ...) the service's contract with rlpipe.
    return Verdict(Fault.PERSISTENT, kind, f"{detail}: the reward service or reward.http is misconfigured")


def judge_error(error: BaseException, url: str, timeout_s: float) -> Verdict:
    """The fault a request that got no HTTP answer met: no connection, no answer in time, TLS or DNS."""
    cause = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(cause, TimeoutError):  # socket.timeout is TimeoutError
        return Verdict(Fault.TRANSIENT, "timeout", f"no answer from {url} within {timeout_s}s")
    if isinstance(cause, ssl.SSLError):  # certificate checks included
        return Verdict(Fault.PERSISTENT, "tls", f"TLS with {url} failed: {cause!r}")
    if isinstance(cause, socket.gaierror):
        return Verdict(Fault.PERSISTENT, "dns", f"the host of {url} does not resolve: {cause!r}")
    # Refused, reset, cut off: nothing listens there yet (a restarting service refuses too) or it went away.
    return Verdict(Fault.TRANSIENT, "connection", f"{url}: {error!r}")


def parse_scores(body: bytes, expected: int) -> list[float]:
    """The ``scores`` of a response body; ``_RequestFailed`` (kind ``malformed``) unless ``expected`` finite numbers."""

    def malformed(reason: str) -> _RequestFailed:
        return _RequestFailed(Verdict(Fault.TRANSIENT, "malformed", reason))

    try:
        scores = json.loads(body)["scores"]
    except (ValueError, KeyError, TypeError) as error:
        raise malformed(f"response is not a JSON object with scores: {error!r}") from None
    if not isinstance(scores, list) or len(scores) != expected:
        raise malformed(f"expected a list of {expected} scores, got {str(scores)[:100]}")
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores):
        raise malformed(f"scores must be finite numbers, got {str(scores)[:100]}")
    return [float(s) for s in scores]


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx comes back as the HTTPError it is (see the module docstring for why none is followed)."""

    def redirect_request(self, *args: object) -> None:
        return None


_OPENER = urllib.request.build_opener(_RefuseRedirects)


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float, max_response_bytes: int) -> bytes:
    """The answer's body; ``_RequestFailed`` or ``RemoteRewardRejected`` as its verdict says."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            answer = response.read(max_response_bytes + 1)  # never the whole of an endless answer
    except urllib.error.HTTPError as error:
        try:
            answer = error.read(ERROR_BODY_BYTES)
        except (OSError, http.client.HTTPException):  # cut off mid-body: the status alone still judges it
            answer = b""
        verdict = judge_status(error.code, answer, url, error.headers.get("Location", ""))
        if verdict.fault == Fault.INPUT:
            raise RemoteRewardRejected(verdict.reason) from None
        raise _RequestFailed(verdict) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:  # refused, reset, cut off, TLS, DNS
        raise _RequestFailed(judge_error(error, url, timeout_s)) from error
    if len(answer) > max_response_bytes:
        raise _RequestFailed(
            Verdict(
                Fault.PERSISTENT,
                "oversized",
                f"the answer from {url} is over reward.http.max_response_bytes={max_response_bytes}",
            )
        )
    return answer


def read_token(token_file: Path) -> str:
    """The bearer token in ``token_file``; ``_RequestFailed`` (persistent) when it cannot be read or is empty."""
    try:
        token = token_file.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise _RequestFailed(
            Verdict(Fault.PERSISTENT, "token", f"reward.http.token_file {str(token_file)!r} is unreadable: {error!r}")
        ) from None
    if not token:
        raise _RequestFailed(Verdict(Fault.PERSISTENT, "token", f"reward.http.token_file {str(token_file)!r} is empty"))
    return token


class RemoteScorer:
    """``await score(items)`` -> one float per item, from the service at ``cfg.url``.

    ``token_file`` may be changed while it runs (a live ``reward.http.token_file``); the file is read
    before each batch, so rewriting it in place rotates the token too.
    """

    def __init__(self, cfg: RewardHttpConfig):
        self.cfg = cfg
        self.token_file = cfg.token_file
        self.breaker = CircuitBreaker(BREAKER_THRESHOLD, BREAKER_COOLDOWN_S, cfg.backoff_s)
        self.limit = asyncio.Semaphore(cfg.max_concurrency)
        self.headers = {"Content-Type": "application/json", **cfg.headers}
        self.down_logged = False
        m = meter()
        self.latency = m.create_histogram(
            "rlpipe_reward_http_latency",
            unit="s",
            description="one request to the remote reward service, by outcome",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.errors = m.create_counter(
            "rlpipe_reward_http_errors", unit="{request}", description="failed requests, by kind"
        )
        self.breaker_gauge = m.create_gauge(
            "rlpipe_reward_http_breaker_state", description="remote reward breaker: 0 closed, 1 half-open, 2 open"
        )
        self.breaker_gauge.set(0)

    async def score(self, items: list[RemoteItem]) -> list[float]:
        headers = dict(self.headers)
        if self.token_file is not None:
            try:
                headers["Authorization"] = f"Bearer {await asyncio.to_thread(read_token, self.token_file)}"
            except _RequestFailed as error:
                self._failed(error, 0.0)
                raise DependencyUnavailable(str(error)) from error
        size = self.cfg.batch_size
        chunks = [items[start : start + size] for start in range(0, len(items), size)]
        scored = await asyncio.gather(*(self._request(chunk, headers) for chunk in chunks))
        return [value for chunk in scored for value in chunk]

    async def _request(self, items: list[RemoteItem], headers: dict[str, str]) -> list[float]:
        body = json.dumps({"items": [asdict(item) for item in items]}).encode()
        cfg = self.cfg
        async with self.limit:
            if self.breaker.state == BreakerState.OPEN:  # known down: the stage waits without sending anything
                raise DependencyUnavailable(
                    f"reward service {cfg.url} is down (breaker open for {self.breaker.retry_in():.1f}s more)"
                )
            for attempt in range(cfg.retries + 1):
                started = time.perf_counter()
                try:
                    answer = await asyncio.to_thread(
                        _post, cfg.url, body, headers, cfg.timeout_s, cfg.max_response_bytes
                    )
                    scores = parse_scores(answer, len(items))
                except _RequestFailed as error:
                    self._failed(error, time.perf_counter() - started)
                    if error.verdict.fault == Fault.PERSISTENT:
                        raise DependencyUnavailable(f"reward service misconfigured or broken: {error}") from error
                    if attempt == cfg.retries:
                        raise DependencyUnavailable(f"reward service failed {attempt + 1} times: {error}") from error
                    await asyncio.sleep(cfg.backoff_s * 2**attempt)
                    continue
                self._succeeded(time.perf_counter() - started)
                return scores
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _failed(self, error: _RequestFailed, seconds: float) -> None:
        self.latency.record(seconds, {"outcome": "error"})
        self.errors.add(1, {"kind": error.kind})
        persistent = error.verdict.fault == Fault.PERSISTENT
        if persistent:
            self.breaker.trip()  # asking again now would meet the same answer
        else:
            self.breaker.failed()
        self.breaker_gauge.set(int(self.breaker.state))
        log_event(log, Event.REWARD_REQUEST_FAILED, level=logging.WARNING, kind=error.kind, error=str(error)[:300])
        if (persistent or self.breaker.failures >= BREAKER_THRESHOLD) and not self.down_logged:
            self.down_logged = True
            log_event(
                log,
                Event.REWARD_SERVICE_DOWN,
                level=logging.ERROR,
                alert=True,
                url=self.cfg.url,
                kind=error.kind,
                failures=self.breaker.failures,
                error=str(error)[:300],
            )

    def _succeeded(self, seconds: float) -> None:
        self.latency.record(seconds, {"outcome": "ok"})
        if self.down_logged:
            self.down_logged = False
            log_event(log, Event.REWARD_SERVICE_RECOVERED, url=self.cfg.url, down_s=round(self.breaker.down_for(), 1))
        self.breaker.succeeded()
        self.breaker_gauge.set(0)
