"""A remote reward service: batched JSON POSTs of (prompt, completion, answer, metadata) -> one score each.

The request and response schema is in docs/rewards.md; ``services.reward.reference_server`` serves it.

Failure policy: ``services.common.transport.http_dependency``'s, with the reward service's own reading of an
error status (``judge_status``: pure, no socket):

- ``TRANSIENT`` (no connection, past ``timeout_s``, HTTP 5xx, 408 or 429, an answer off the schema): retried
  ``retries`` times, waiting ``backoff_s`` doubled each time.
- ``PERSISTENT`` (401, 403, 404, 405 and any other status that does not blame the input, a redirect, a TLS or DNS
  failure, an answer over ``max_response_bytes``, a ``token_file`` that cannot be read or holds no sendable token):
  not retried, the breaker opens at once and ``reward_service_down`` names the status. The scorer raises
  ``DependencyRefused``: the stage holds the groups like any outage, but alerts at once (``dependency_down``, and
  through the replica's presence entry the trainer's ``dependency_refused`` in the run's events), since waiting
  will not fix a refused token.
- ``INPUT``: only a 400 or 422 with ``{"error": reason}`` blames the input: ``RemoteRewardRejected``, which the
  stage retries and dead-letters like any failing compute. Without a reason it is a proxy's or another service's
  answer, which would refuse every input: persistent.

``http_dependency.BREAKER_THRESHOLD`` transient failures in a row, or one persistent one, open the breaker, and
while it is open no request is sent. When a batch cannot be scored the scorer raises ``DependencyUnavailable``: the
stage holds the groups (no delivery spent, nothing dead-lettered, nothing scored 0) and tries again behind its own
breaker. The breaker opening logs ``reward_service_down`` (an alert) and its closing ``reward_service_recovered``;
latency, errors and the breaker's state are metrics (``rlpipe_reward_http_*``).

The token is read from ``token_file`` before each batch, so rewriting the file rotates it; the path itself is a
security setting (set where the reward role is deployed). No error, log line or event quotes a credential: a
token is checked before it goes into a header (``services.common.config.tokens``), and a service's answer that
echoes a header value has it replaced before the answer is quoted.

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

from services.common.config import REDACTED, RewardHttpConfig, TokenError, read_token_file
from services.common.observe.events import Event
from services.common.transport.breaker import CircuitBreaker, DependencyRefused, DependencyUnavailable
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


def unechoed(answer: bytes, headers: dict[str, str]) -> bytes:
    """``answer`` with every header value this request sent (and a bearer token on its own) replaced, so that a
    service that echoes the request ("invalid token abc...") cannot put a credential into our logs."""
    sent = {value for value in headers.values() if len(value) >= 4}
    sent |= {value.removeprefix("Bearer ") for value in sent if value.startswith("Bearer ") and len(value) >= 11}
    for value in sorted(sent, key=len, reverse=True):
        answer = answer.replace(value.encode("latin-1", "replace"), REDACTED.encode())
    return answer


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float, max_response_bytes: int) -> bytes:
    """The answer's body; ``RequestFailed`` with its verdict when there is none."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with NO_REDIRECTS.open(request, timeout=timeout_s) as response:
            answer = response.read(max_response_bytes + 1)  # never the whole of an endless answer
    except urllib.error.HTTPError as error:
        try:
            answer = unechoed(error.read(ERROR_BODY_BYTES), headers)
        except (OSError, http.client.HTTPException):  # cut off mid-body: the status alone still judges it
            answer = b""
        raise RequestFailed(judge_status(error.code, answer, url, error.headers.get("Location", ""))) from None
    except ValueError as error:
        # http.client refuses a header it cannot send, quoting it whole: the message would carry the token.
        # Checked tokens never get here; a header from headers_from_env changed under us might.
        raise RequestFailed(
            Verdict(
                Fault.PERSISTENT,
                "header",
                f"a request header to {url} cannot be sent ({type(error).__name__}): check reward.http.token_file "
                "and the variables of reward.http.headers_from_env",
            )
        ) from None
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
    """The bearer token in ``token_file``; ``RequestFailed`` (persistent, kind ``token``) when it cannot be read or
    is not a sendable token. The reason names the field, the file and the problem, never the token."""
    try:
        return read_token_file(token_file, "reward.http.token_file")
    except TokenError as error:
        raise RequestFailed(Verdict(Fault.PERSISTENT, "token", str(error))) from None


class RemoteScorer:
    """``await score(items)`` -> one float per item, from the service at ``cfg.url``.

    ``cfg.token_file`` is read before each batch, so rewriting it rotates the token without a restart.
    """

    def __init__(self, cfg: RewardHttpConfig):
        self.cfg = cfg
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
        if self.cfg.token_file is not None:
            try:
                headers["Authorization"] = f"Bearer {await asyncio.to_thread(read_token, self.cfg.token_file)}"
            except RequestFailed as error:
                self.service.failed(error.verdict, 0.0)
                raise DependencyRefused(error.kind, str(error)) from None
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
                    raise DependencyRefused(error.kind, f"reward service misconfigured or broken: {error}") from error
                raise DependencyUnavailable(f"reward service failed {error.attempts} times: {error}") from error
