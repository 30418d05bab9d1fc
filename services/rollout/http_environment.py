"""An environment served over HTTP (``rollout.environment_url``): JSON POSTs to ``<url>/reset`` and ``<url>/step``.

    POST <url>/reset  {"episode_id", "prompt_id", "prompt", "answer"}  ->  {"prompt": "..."}
    POST <url>/step   {"episode_id", "text", "token_ids"}
                      ->  {"observation": "...", "reward_part": 0.0, "done": false, "tool_call": false,
                           "tool_error": false, "info": {}}

docs/agents.md has the schema. Failure policy, as the remote reward's (services.reward.remote): no connection, no
answer within ``rollout.environment_timeout_s``, a 5xx, 408 or 429, or an answer off the schema is transient,
retried ``rollout.environment_retries`` times with doubling backoff; a 400 or 422 is the environment rejecting this
turn (the episode ends as env_error, nothing retried); any other status says the URL or the service is wrong and
opens the breaker at once. Every client shares one ``CircuitBreaker``: while it is open no request is sent and
the episodes asking end as env_error (a reset, which no episode has spent tokens on yet, holds the batch instead:
see ``episodes.start_episodes``). Opening logs ``environment_service_down`` (an alert), closing
``environment_service_recovered``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from services.common.config import RolloutConfig
from services.common.observe.events import Event
from services.common.observe.instruments import LATENCY_BUCKETS_S
from services.common.observe.logs import log_event
from services.common.observe.telemetry import meter
from services.common.transport.breaker import BreakerState, CircuitBreaker
from services.rollout.environments import EnvironmentFailed, StepResult, Task, Turn

log = logging.getLogger(__name__)
R = TypeVar("R")

BREAKER_THRESHOLD = 3  # transient failures in a row that open the breaker
BREAKER_COOLDOWN_S = 5.0  # while open, one request is let through this often
BACKOFF_S = 0.25  # before the first retry, doubled for each next one
MAX_RESPONSE_BYTES = 1 << 20
REJECTS_TURN = (400, 422)
TRANSIENT_STATUS = (408, 429)  # and every 5xx


@dataclass
class _Failure(Exception):
    """A request that failed: ``kind`` names how (the metrics' label), ``transient`` whether retrying may help."""

    kind: Literal["timeout", "connection", "status", "malformed", "rejected"]
    transient: bool
    reason: str

    def __str__(self) -> str:
        return self.reason


def _post(url: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as error:
        status = error.code
        if status in REJECTS_TURN:
            raise _Failure("rejected", False, f"{url} rejected the turn with {status}") from None
        transient = status >= 500 or status in TRANSIENT_STATUS
        raise _Failure("status", transient, f"{url} answered {status}") from None
    except (urllib.error.URLError, OSError) as error:
        cause = error.reason if isinstance(error, urllib.error.URLError) else error
        if isinstance(cause, TimeoutError):
            raise _Failure("timeout", True, f"no answer from {url} within {timeout_s:g}s") from None
        raise _Failure("connection", True, f"{url}: {error!r}"[:300]) from None
    if len(body) > MAX_RESPONSE_BYTES:
        raise _Failure("malformed", True, f"the answer from {url} is over {MAX_RESPONSE_BYTES} bytes")
    try:
        answer = json.loads(body)
    except ValueError as error:
        raise _Failure("malformed", True, f"the answer from {url} is not JSON: {error}") from None
    if not isinstance(answer, dict):
        raise _Failure("malformed", True, f"the answer from {url} is not a JSON object")
    return answer


def parse_reset(answer: dict[str, Any]) -> str:
    """The prompt text of a /reset answer; ``_Failure`` (malformed) without one."""
    prompt = answer.get("prompt")
    if not isinstance(prompt, str):
        raise _Failure("malformed", True, f"a /reset answer without a prompt text: {json.dumps(answer)[:200]}")
    return prompt


def parse_step(answer: dict[str, Any]) -> StepResult:
    """A StepResult from a /step answer; ``_Failure`` (malformed) when it is off the schema."""
    observation, reward_part = answer.get("observation", ""), answer.get("reward_part", 0.0)
    flags = {name: answer.get(name, False) for name in ("done", "tool_call", "tool_error")}
    info = answer.get("info", {})
    if (
        not isinstance(observation, str)
        or isinstance(reward_part, bool)
        or not isinstance(reward_part, (int, float))
        or not math.isfinite(reward_part)
        or not all(isinstance(flag, bool) for flag in flags.values())
        or not isinstance(info, dict)
    ):
        raise _Failure("malformed", True, f"a /step answer off the schema: {json.dumps(answer)[:200]}")
    return StepResult(observation=observation, reward_part=float(reward_part), info=info, **flags)


class HttpEnvironmentClient:
    """What every episode's ``HttpEnvironment`` shares: the URL, the limits, one breaker and the metrics."""

    def __init__(self, cfg: RolloutConfig):
        self.url = cfg.environment_url.rstrip("/")
        self.timeout_s = cfg.environment_timeout_s
        self.retries = cfg.environment_retries
        self.breaker = CircuitBreaker(BREAKER_THRESHOLD, BREAKER_COOLDOWN_S, BACKOFF_S)
        self.down_logged = False
        m = meter()
        self.latency = m.create_histogram(
            "rlpipe_rollout_env_http_latency",
            unit="s",
            description="one request to the HTTP environment, by outcome",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.errors = m.create_counter(
            "rlpipe_rollout_env_http_errors", unit="{request}", description="failed environment requests, by kind"
        )
        self.breaker_gauge = m.create_gauge(
            "rlpipe_rollout_env_http_breaker_state",
            description="HTTP environment breaker: 0 closed, 1 half-open, 2 open",
        )
        self.breaker_gauge.set(0)

    def episode(self) -> HttpEnvironment:
        return HttpEnvironment(self, uuid.uuid4().hex)

    async def request(self, path: str, payload: dict[str, Any], parse: Callable[[dict[str, Any]], R]) -> R:
        """The ``parse``d answer to one POST, retried as the module docstring says; EnvironmentFailed when there is
        none (``timeout`` when the last attempt got no answer in time)."""
        url = f"{self.url}/{path}"
        if self.breaker.state == BreakerState.OPEN:
            raise EnvironmentFailed("env_error", f"environment {self.url} is down (breaker open)")
        for attempt in range(self.retries + 1):
            started = time.perf_counter()
            try:
                answer = parse(await asyncio.to_thread(_post, url, payload, self.timeout_s))
            except _Failure as failure:
                self._failed(failure, time.perf_counter() - started)
                if not failure.transient or attempt == self.retries:
                    outcome = "timeout" if failure.kind == "timeout" else "env_error"
                    raise EnvironmentFailed(outcome, str(failure)) from None
                await asyncio.sleep(BACKOFF_S * 2**attempt)
                continue
            self._succeeded(time.perf_counter() - started)
            return answer
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _failed(self, failure: _Failure, seconds: float) -> None:
        self.latency.record(seconds, {"outcome": "error"})
        self.errors.add(1, {"kind": failure.kind})
        log_event(log, Event.ENVIRONMENT_REQUEST_FAILED, level=logging.WARNING, kind=failure.kind, error=str(failure))
        if failure.kind == "rejected":
            return  # the environment is up and judged this turn
        if failure.transient:
            self.breaker.failed()
        else:
            self.breaker.trip()  # asking again now would meet the same answer
        self.breaker_gauge.set(int(self.breaker.state))
        if self.breaker.state != BreakerState.CLOSED and not self.down_logged:
            self.down_logged = True
            log_event(
                log,
                Event.ENVIRONMENT_SERVICE_DOWN,
                level=logging.ERROR,
                alert=True,
                url=self.url,
                kind=failure.kind,
                failures=self.breaker.failures,
                error=str(failure),
            )

    def _succeeded(self, seconds: float) -> None:
        self.latency.record(seconds, {"outcome": "ok"})
        if self.down_logged:
            self.down_logged = False
            log_event(log, Event.ENVIRONMENT_SERVICE_RECOVERED, url=self.url, down_s=round(self.breaker.down_for(), 1))
        self.breaker.succeeded()
        self.breaker_gauge.set(0)


class HttpEnvironment:
    """One episode of the HTTP environment (an ``EpisodeEnvironment``), named by its ``episode_id``."""

    def __init__(self, client: HttpEnvironmentClient, episode_id: str):
        self.client = client
        self.episode_id = episode_id

    async def reset(self, task: Task) -> str:
        payload = {"episode_id": self.episode_id, "prompt_id": task.prompt_id, "prompt": task.prompt}
        return await self.client.request("reset", payload | {"answer": task.answer}, parse_reset)

    async def step(self, turn: Turn) -> StepResult:
        payload = {"episode_id": self.episode_id, "text": turn.text, "token_ids": list(turn.token_ids)}
        return await self.client.request("step", payload, parse_step)
