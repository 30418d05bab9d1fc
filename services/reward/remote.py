"""A remote reward service: batched JSON POSTs of (prompt, completion, answer, metadata) -> one score each.

The request and response schema is in docs/rewards.md; ``services.reward.reference_server`` serves it.

Failure policy. A request that fails (no connection, past ``timeout_s``, HTTP 5xx, 408 or 429, or an
answer that does not fit the schema: the wrong number of scores, a score that is not a finite number)
is retried ``retries`` times, waiting ``backoff_s`` doubled each time. Every failure feeds a
``CircuitBreaker``: after ``BREAKER_THRESHOLD`` in a row it opens, and while it is open no request is
sent. When a batch cannot be scored the scorer raises ``DependencyUnavailable``: the stage holds the
groups (no delivery spent, nothing dead-lettered, nothing scored 0) and tries again behind its own
breaker. Only a 4xx other than 408/429 says the input itself is bad: ``RemoteRewardRejected``, which
the stage retries and dead-letters like any failing compute. The breaker opening logs
``reward_service_down`` (an alert) and its closing ``reward_service_recovered``; latency, errors and
the breaker's state are metrics (``rlpipe_reward_http_*``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import math
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

from services.common.config import RewardHttpConfig
from services.common.observe.logs import log_event
from services.common.observe.telemetry import LATENCY_BUCKETS_S, meter
from services.common.transport.bus import BreakerState, CircuitBreaker, DependencyUnavailable

log = logging.getLogger(__name__)

BREAKER_THRESHOLD = 3  # failed requests in a row that open the breaker
BREAKER_COOLDOWN_S = 5.0  # while open, one request is let through this often
RETRYABLE_STATUS = (408, 429)


@dataclass(frozen=True)
class RemoteItem:
    """One completion to score, as it goes on the wire."""

    prompt: str
    completion: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


class RemoteRewardRejected(RuntimeError):
    """The reward service refused the request as bad input (HTTP 4xx other than 408/429)."""


class _RequestFailed(Exception):
    """One request failed in a way that says nothing about its input; ``kind`` labels the error metric."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


def parse_scores(body: bytes, expected: int) -> list[float]:
    """The ``scores`` of a response body; ``_RequestFailed("malformed")`` unless ``expected`` finite numbers."""
    try:
        scores = json.loads(body)["scores"]
    except (ValueError, KeyError, TypeError) as error:
        raise _RequestFailed("malformed", f"response is not a JSON object with scores: {error!r}") from None
    if not isinstance(scores, list) or len(scores) != expected:
        raise _RequestFailed("malformed", f"expected a list of {expected} scores, got {str(scores)[:100]}")
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores):
        raise _RequestFailed("malformed", f"scores must be finite numbers, got {str(scores)[:100]}")
    return [float(s) for s in scores]


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> bytes:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        detail = f"HTTP {error.code} from {url}: {error.read()[:300]!r}"
        if 400 <= error.code < 500 and error.code not in RETRYABLE_STATUS:
            raise RemoteRewardRejected(detail) from None
        raise _RequestFailed(f"http_{error.code}", detail) from None
    except TimeoutError as error:
        raise _RequestFailed("timeout", f"no answer from {url} within {timeout_s}s") from error
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:  # refused, reset, cut off, DNS
        kind = "timeout" if isinstance(getattr(error, "reason", None), TimeoutError) else "connection"
        raise _RequestFailed(kind, f"{url}: {error!r}") from error


class RemoteScorer:
    """``await score(items)`` -> one float per item, from the service at ``cfg.url``."""

    def __init__(self, cfg: RewardHttpConfig):
        self.cfg = cfg
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
        size = self.cfg.batch_size
        chunks = [items[start : start + size] for start in range(0, len(items), size)]
        scored = await asyncio.gather(*(self._request(chunk) for chunk in chunks))
        return [value for chunk in scored for value in chunk]

    async def _request(self, items: list[RemoteItem]) -> list[float]:
        body = json.dumps({"items": [asdict(item) for item in items]}).encode()
        async with self.limit:
            if self.breaker.state == BreakerState.OPEN:  # known down: the stage waits without sending anything
                raise DependencyUnavailable(
                    f"reward service {self.cfg.url} is down (breaker open for {self.breaker.retry_in():.1f}s more)"
                )
            for attempt in range(self.cfg.retries + 1):
                started = time.perf_counter()
                try:
                    answer = await asyncio.to_thread(_post, self.cfg.url, body, self.headers, self.cfg.timeout_s)
                    scores = parse_scores(answer, len(items))
                except _RequestFailed as error:
                    self._failed(error, time.perf_counter() - started)
                    if attempt == self.cfg.retries:
                        raise DependencyUnavailable(f"reward service failed {attempt + 1} times: {error}") from error
                    await asyncio.sleep(self.cfg.backoff_s * 2**attempt)
                    continue
                self._succeeded(time.perf_counter() - started)
                return scores
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _failed(self, error: _RequestFailed, seconds: float) -> None:
        self.latency.record(seconds, {"outcome": "error"})
        self.errors.add(1, {"kind": error.kind})
        self.breaker.failed()
        self.breaker_gauge.set(int(self.breaker.state))
        log_event(log, "reward_request_failed", level=logging.WARNING, kind=error.kind, error=str(error)[:300])
        if self.breaker.failures >= BREAKER_THRESHOLD and not self.down_logged:
            self.down_logged = True
            log_event(
                log,
                "reward_service_down",
                level=logging.ERROR,
                alert=True,
                url=self.cfg.url,
                failures=self.breaker.failures,
                error=str(error)[:300],
            )

    def _succeeded(self, seconds: float) -> None:
        self.latency.record(seconds, {"outcome": "ok"})
        if self.down_logged:
            self.down_logged = False
            log_event(log, "reward_service_recovered", url=self.cfg.url, down_s=round(self.breaker.down_for(), 1))
        self.breaker.succeeded()
        self.breaker_gauge.set(0)
