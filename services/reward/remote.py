"""A remote reward service: batched JSON POSTs of (prompt, completion, answer, metadata) -> one score each.

The request and response schema is in docs/rewards.md; ``services.reward.reference_server`` serves it.

Failure policy: ``services.common.transport.http_dependency``'s, with the reward service's own reading of an
error status (``judge_status``: pure, no socket):

- ``TRANSIENT`` (no connection, past ``timeout_s``, HTTP 5xx, 408 or 429, an answer off the schema): retried
  ``retries`` times, waiting ``backoff_s`` doubled each time.
- ``PERSISTENT`` (401, 403, 404, 405 and any other status that does not blame the input, a redirect, a TLS or DNS
  failure, an answer over ``max_response_bytes``, an unreadable ``token_file``): not retried, the breaker opens at
  once and ``reward_service_down`` names the status.
- ``INPUT``: only a 400 or 422 with ``{"error": reason}`` blames the input: ``RemoteRewardRejected``, which the
  stage retries and dead-letters like any failing compute. Without a reason it is a proxy's or another service's
  answer, which would refuse every input: persistent.

``http_dependency.BREAKER_THRESHOLD`` transient failures in a row, or one persistent one, open the breaker, and
while it is open no request is sent. When a batch cannot be scored the scorer raises ``DependencyUnavailable``: the
stage holds the groups (no delivery spent, nothing dead-lettered, nothing scored 0) and tries again behind its own
breaker. The breaker opening logs ``reward_service_down`` (an alert) and its closing ``reward_service_recovered``;
latency, errors and the breaker's state are metrics (``rlpipe_reward_http_*``).

Redirects are not followed: a POST cannot be replayed safely as the GET that 301/302/303 turn it
into, and following one would send the bearer token to whatever host the answer names. A moved
service is a configuration to fix (``reward.http.url``), so a redirect is a persistent fault naming
its ``Location``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.common.config import RewardHttpConfig
from services.common.observe.events import Event
from services.common.transport.breaker import CircuitBreaker, DependencyUnavailable
from services.common.transport.http_dependency import (
    NO_REDIRECTS,
    DependencyEvents,
    Fault,
    HttpDependency,
    RequestFailed,
    Verdict,
    fault_of_status,
    judge_error,
)

ERROR_BODY_BYTES = 4096  # of a failed answer's body, enough for its reason
EVENTS = DependencyEvents(Event.REWARD_REQUEST_FAILED, Event.REWARD_SERVICE_DOWN, Event.REWARD_SERVICE_RECOVERED)


@dataclass(frozen=True)
class RemoteItem:
    """One completion to score, as it goes on the wire."""

    prompt: str
    completion: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


class RemoteRewardRejected(RuntimeError):
    """The reward service refused the request as bad input (HTTP 400 or 422 with a reason)."""


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
    fault = fault_of_status(status)
    if fault == Fault.INPUT:
        reason = _stated_reason(body)
        if reason:
            return Verdict(Fault.INPUT, kind, f"HTTP {status} from {url}: {reason[:300]}")
        # Not the schema's refusal: a proxy or another service at this URL, which would refuse every input.
        return Verdict(Fault.PERSISTENT, kind, f"{detail} gives no reason (no JSON error field): is {url} the service?")
    if fault == Fault.TRANSIENT:
        return Verdict(Fault.TRANSIENT, kind, detail)
    if 300 <= status < 400:
        return Verdict(
            Fault.PERSISTENT,
            kind,
            f"HTTP {status} from {url} redirects to {location!r}, which is not followed: "
            "set reward.http.url to the service's address",
        )
    return Verdict(Fault.PERSISTENT, kind, f"{detail}: the reward service or reward.http is misconfigured")


def parse_scores(body: bytes, expected: int) -> list[float]:
    """The ``scores`` of a response body; ``RequestFailed`` (kind ``malformed``) unless ``expected`` finite numbers."""

    def malformed(reason: str) -> RequestFailed:
        return RequestFailed(Verdict(Fault.TRANSIENT, "malformed", reason))

    try:
        scores = json.loads(body)["scores"]
    except (ValueError, KeyError, TypeError) as error:
        raise malformed(f"response is not a JSON object with scores: {error!r}") from None
    if not isinstance(scores, list) or len(scores) != expected:
        raise malformed(f"expected a list of {expected} scores, got {str(scores)[:100]}")
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores):
        raise malformed(f"scores must be finite numbers, got {str(scores)[:100]}")
    return [float(s) for s in scores]


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float, max_response_bytes: int) -> bytes:
    """The answer's body; ``RequestFailed`` with its verdict when there is none."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with NO_REDIRECTS.open(request, timeout=timeout_s) as response:
            answer = response.read(max_response_bytes + 1)  # never the whole of an endless answer
    except urllib.error.HTTPError as error:
        try:
            answer = error.read(ERROR_BODY_BYTES)
        except (OSError, http.client.HTTPException):  # cut off mid-body: the status alone still judges it
            answer = b""
        raise RequestFailed(judge_status(error.code, answer, url, error.headers.get("Location", ""))) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:  # refused, reset, cut off, TLS, DNS
        raise RequestFailed(judge_error(error, url, timeout_s)) from error
    if len(answer) > max_response_bytes:
        raise RequestFailed(
            Verdict(
                Fault.PERSISTENT,
                "oversized",
                f"the answer from {url} is over reward.http.max_response_bytes={max_response_bytes}",
            )
        )
    return answer


def read_token(token_file: Path) -> str:
    """The bearer token in ``token_file``; ``RequestFailed`` (persistent) when it cannot be read or is empty."""
    try:
        token = token_file.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise RequestFailed(
            Verdict(Fault.PERSISTENT, "token", f"reward.http.token_file {str(token_file)!r} is unreadable: {error!r}")
        ) from None
    if not token:
        raise RequestFailed(Verdict(Fault.PERSISTENT, "token", f"reward.http.token_file {str(token_file)!r} is empty"))
    return token


class RemoteScorer:
    """``await score(items)`` -> one float per item, from the service at ``cfg.url``.

    ``token_file`` may be changed while it runs (a live ``reward.http.token_file``); the file is read
    before each batch, so rewriting it in place rotates the token too.
    """

    def __init__(self, cfg: RewardHttpConfig):
        self.cfg = cfg
        self.token_file = cfg.token_file
        self.service = HttpDependency(
            cfg.url,
            "the remote reward service",
            "rlpipe_reward_http",
            EVENTS,
            cfg.backoff_s,
        )
        self.limit = asyncio.Semaphore(cfg.max_concurrency)
        self.headers = {"Content-Type": "application/json", **cfg.headers}

    @property
    def breaker(self) -> CircuitBreaker:
        return self.service.breaker

    @property
    def down_logged(self) -> bool:
        return self.service.down_logged

    async def score(self, items: list[RemoteItem]) -> list[float]:
        headers = dict(self.headers)
        if self.token_file is not None:
            try:
                headers["Authorization"] = f"Bearer {await asyncio.to_thread(read_token, self.token_file)}"
            except RequestFailed as error:
                self.service.failed(error.verdict, 0.0)
                raise DependencyUnavailable(str(error)) from error
        size = self.cfg.batch_size
        chunks = [items[start : start + size] for start in range(0, len(items), size)]
        scored = await asyncio.gather(*(self._request(chunk, headers) for chunk in chunks))
        return [value for chunk in scored for value in chunk]

    async def _request(self, items: list[RemoteItem], headers: dict[str, str]) -> list[float]:
        body = json.dumps({"items": [asdict(item) for item in items]}).encode()
        cfg = self.cfg

        def scores() -> list[float]:
            return parse_scores(_post(cfg.url, body, headers, cfg.timeout_s, cfg.max_response_bytes), len(items))

        async with self.limit:
            try:
                return await self.service.call(scores, cfg.retries)
            except RequestFailed as error:
                if error.fault == Fault.INPUT:
                    raise RemoteRewardRejected(str(error)) from None
                if error.fault == Fault.PERSISTENT:
                    raise DependencyUnavailable(f"reward service misconfigured or broken: {error}") from error
                raise DependencyUnavailable(f"reward service failed {error.attempts} times: {error}") from error
