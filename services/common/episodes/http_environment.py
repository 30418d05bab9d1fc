"""An environment served over HTTP (``rollout.environment_url``): JSON POSTs to ``<url>/reset`` and ``<url>/step``.

    POST <url>/reset  {"episode_id", "prompt_id", "prompt", "answer", "info"}  ->  {"prompt": "..."}
    POST <url>/step   {"episode_id", "text", "token_ids"}
                      ->  {"observation": "...", "reward_part": 0.0, "done": false, "tool_call": false,
                           "tool_error": false, "info": {}}
    POST <url>/close  {"episode_id"}  ->  {}   (an episode that ended without the service's done; best effort)

docs/agents.md has the schema. Failure policy: ``services.common.transport.http_dependency``'s, which the remote
reward shares. No connection, no answer within ``rollout.environment_timeout_s``, a 5xx, 408 or 429, or an answer off
the schema is transient, retried ``rollout.environment_retries`` times with doubling backoff; a 400 or 422 is the
environment rejecting this turn (the episode ends as env_error, nothing retried, the breaker untouched); any other
status (a redirect too: none is followed, so no prompt or answer goes to the host it names), a TLS or a DNS failure
says the URL or the service is wrong and opens the breaker at once. Every client shares one breaker: while it is
open no request is sent and the episodes asking end as env_error (a reset, which no episode has spent tokens on yet,
holds the batch instead: see ``episodes.start_episodes``; a reset the service refuses, by status, TLS or DNS,
holds it as ``DependencyRefused``, which alerts at once). Opening logs ``environment_service_down`` (an alert),
closing ``environment_service_recovered``. The client sends no credential of its own.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.common.config import RolloutConfig
from services.common.episodes.environments import EnvironmentFailed, StepResult, Task, Turn, as_plain, off_schema
from services.common.observe.events import Event
from services.common.transport.breaker import BreakerState, CircuitBreaker
from services.common.transport.http_dependency import (
    NO_REDIRECTS,
    BreakerOpen,
    DependencyEvents,
    Fault,
    HttpDependency,
    RequestFailed,
    Verdict,
    fault_of_status,
    judge_error,
)

R = TypeVar("R")
log = logging.getLogger(__name__)
# Closing episodes: a few threads of their own, and a short wait for each answer.
CLOSE_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="environment-close")
CLOSE_TIMEOUT_S = 2.0

BACKOFF_S = 0.25  # before the first retry, doubled for each next one
MAX_RESPONSE_BYTES = 1 << 20
EVENTS = DependencyEvents(
    Event.ENVIRONMENT_REQUEST_FAILED, Event.ENVIRONMENT_SERVICE_DOWN, Event.ENVIRONMENT_SERVICE_RECOVERED
)


def malformed(reason: str) -> RequestFailed:
    """An answer off the schema: the service's failure, for now."""
    return RequestFailed(Verdict(Fault.TRANSIENT, "malformed", reason))


def _post(url: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with NO_REDIRECTS.open(request, timeout=timeout_s) as response:
            body = response.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as error:
        status, fault = error.code, fault_of_status(error.code)
        if fault == Fault.INPUT:
            raise RequestFailed(Verdict(fault, "rejected", f"{url} rejected the turn with {status}")) from None
        if 300 <= status < 400:  # persistent: the prompt, the answer and the episode go nowhere else
            moved = f"{url} answered {status} to {error.headers.get('Location', '')!r}, which is not followed"
            raise RequestFailed(
                Verdict(fault, f"http_{status}", f"{moved}: set rollout.environment_url to the service")
            ) from None
        raise RequestFailed(Verdict(fault, f"http_{status}", f"{url} answered {status}")) from None
    except (urllib.error.URLError, OSError) as error:
        raise RequestFailed(judge_error(error, url, timeout_s)) from None
    if len(body) > MAX_RESPONSE_BYTES:
        raise malformed(f"the answer from {url} is over {MAX_RESPONSE_BYTES} bytes")
    try:
        answer = json.loads(body)
    except ValueError as error:
        raise malformed(f"the answer from {url} is not JSON: {error}") from None
    if not isinstance(answer, dict):
        raise malformed(f"the answer from {url} is not a JSON object")
    return answer


def parse_reset(answer: dict[str, Any]) -> str:
    """The prompt text of a /reset answer; ``RequestFailed`` (malformed) without one."""
    prompt = answer.get("prompt")
    if not isinstance(prompt, str):
        raise malformed(f"a /reset answer without a prompt text: {json.dumps(answer)[:200]}")
    return prompt


def parse_step(answer: dict[str, Any]) -> StepResult:
    """A StepResult from a /step answer; ``RequestFailed`` (malformed) when it is off the schema."""
    result = StepResult(
        observation=answer.get("observation", ""),
        reward_part=answer.get("reward_part", 0.0),
        done=answer.get("done", False),
        tool_call=answer.get("tool_call", False),
        tool_error=answer.get("tool_error", False),
        info=answer.get("info", {}),
    )
    if off_schema(result):
        raise malformed(f"a /step answer off the schema: {json.dumps(answer)[:200]}")
    return as_plain(result)


class HttpEnvironmentClient:
    """What every episode's ``HttpEnvironment`` shares: the URL, the limits, and the service's breaker and metrics."""

    def __init__(self, cfg: RolloutConfig):
        self.url = cfg.environment_url.rstrip("/")
        self.timeout_s = cfg.environment_timeout_s
        self.retries = cfg.environment_retries
        self.service = HttpDependency(
            self.url,
            "the HTTP environment",
            "rlpipe_rollout_env_http",
            EVENTS,
            BACKOFF_S,
        )

    @property
    def breaker(self) -> CircuitBreaker:
        return self.service.breaker

    def episode(self) -> HttpEnvironment:
        return HttpEnvironment(self, uuid.uuid4().hex)

    async def request(self, path: str, payload: dict[str, Any], parse: Callable[[dict[str, Any]], R]) -> R:
        """The ``parse``d answer to one POST, retried as the module docstring says; EnvironmentFailed when there is
        none (``timeout`` when the last attempt got no answer in time)."""
        url = f"{self.url}/{path}"
        try:
            return await self.service.call(lambda: parse(_post(url, payload, self.timeout_s)), self.retries)
        except BreakerOpen as error:
            raise EnvironmentFailed("env_error", str(error)) from None
        except RequestFailed as failure:
            outcome = "timeout" if failure.kind == "timeout" else "env_error"
            refused = failure.kind if failure.fault == Fault.PERSISTENT else ""
            raise EnvironmentFailed(outcome, str(failure), refused) from None


class HttpEnvironment:
    """One episode of the HTTP environment (an ``EpisodeEnvironment``), named by its ``episode_id``."""

    def __init__(self, client: HttpEnvironmentClient, episode_id: str):
        self.client = client
        self.episode_id = episode_id
        self.open = False  # reset and not yet ended by the service itself (a step answered done)

    async def reset(self, task: Task) -> str:
        payload = {"episode_id": self.episode_id, "prompt_id": task.prompt_id, "prompt": task.prompt}
        payload |= {"answer": task.answer, "info": task.info}
        prompt = await self.client.request("reset", payload, parse_reset)
        self.open = True
        return prompt

    async def step(self, turn: Turn) -> StepResult:
        payload = {"episode_id": self.episode_id, "text": turn.text, "token_ids": list(turn.token_ids)}
        result = await self.client.request("step", payload, parse_step)
        self.open = not result.done  # a service forgets an episode it ended
        return result

    async def close(self) -> None:
        """Tell the service an episode it did not end itself is over: one POST to ``/close``, sent in the
        background on a few threads of its own with a short timeout and never retried, so closing never holds the
        batch (nor the threads its steps use); skipped while the breaker is open. A failure costs the service some
        memory, not the episode."""
        if not self.open:
            return
        self.open = False
        if self.client.breaker.state is not BreakerState.CLOSED:
            return
        payload = {"episode_id": self.episode_id}
        CLOSE_THREADS.submit(_close, f"{self.client.url}/close", payload)


def _close(url: str, payload: dict[str, Any]) -> None:
    try:
        _post(url, payload, CLOSE_TIMEOUT_S)
    except Exception as error:  # best effort: a service that cannot be told now only keeps the episode longer
        log.debug("environment close failed", extra={"fields": {"error": repr(error)[:200]}})
