"""The environment one episode talks to: what both kinds answer (``EpisodeEnvironment``), the in-process one run
on a thread under a time limit (``LocalEnvironment``), and which of them a config makes (``environment_maker``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from services.common.config import RolloutConfig
from services.common.episodes.environments import (
    Environment,
    EnvironmentFailed,
    StepResult,
    Task,
    Turn,
    as_plain,
    environment_factory,
    off_schema,
    python_tool,
)
from services.common.episodes.http_environment import HttpEnvironmentClient

Argument = TypeVar("Argument", Task, Turn)  # what an environment's call takes


class EpisodeEnvironment(Protocol):
    """One episode's environment as the loop drives it: each call raises EnvironmentFailed, never anything else."""

    async def reset(self, task: Task) -> str: ...

    async def step(self, turn: Turn) -> StepResult: ...

    async def close(self) -> None:
        """The episode is over, however it ended: what the environment holds for it may go. Never raises."""


# Plugin environments' calls, apart from asyncio's default pool (a few threads on a small machine): a batch's
# episodes step at once, and a hung step holds one of these, not a thread the rest of the rollout needs.
ENVIRONMENT_THREADS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="environment")


class LocalEnvironment:
    """A plugin environment in this process: each call in a worker thread, under the time limit.

    A thread cannot be killed, so a step past the limit is abandoned (its episode ends as ``timeout``) and
    finishes, or not, in the background; an environment that can hang should run its work in a process of its
    own, as the built-in Python tool does."""

    def __init__(self, environment: Environment, timeout_s: float):
        self.environment = environment
        self.timeout_s = timeout_s

    async def reset(self, task: Task) -> str:
        text = await self._call(self.environment.reset, task)
        if not isinstance(text, str):
            raise EnvironmentFailed("env_error", f"reset returned {type(text).__name__}, not the prompt text")
        return text

    async def step(self, turn: Turn) -> StepResult:
        result = await self._call(self.environment.step, turn)
        if not isinstance(result, StepResult):
            raise EnvironmentFailed("env_error", f"step returned {type(result).__name__}, not a StepResult")
        if why := off_schema(result):
            raise EnvironmentFailed("env_error", f"step returned a StepResult off the schema: {why}")
        return as_plain(result)

    async def close(self) -> None:
        pass  # the plugin instance is the episode's own: it goes with the episode

    async def _call(self, method: Callable[[Argument], object], argument: Argument) -> object:
        try:
            call = asyncio.get_running_loop().run_in_executor(ENVIRONMENT_THREADS, method, argument)
            return await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError:
            raise EnvironmentFailed("timeout", f"no answer within {self.timeout_s:g}s") from None
        except Exception as error:  # a plugin may fail in any way: that ends its episode, never the rollout
            raise EnvironmentFailed("env_error", repr(error)[:300]) from None


def environment_maker(rollout: RolloutConfig) -> Callable[[], EpisodeEnvironment]:
    """What makes one episode's environment for ``rollout``: the HTTP service's client, or the named class in this
    process under the time limit (the rollout's episodes and the trainer's held-out evaluation alike)."""
    if rollout.environment_url:
        return HttpEnvironmentClient(rollout).episode
    environment, timeout_s = rollout.environment, rollout.environment_timeout_s
    # The Python tool's box is decided here, at start: refused where none can be built unless the config allows
    # running model-written code unboxed.
    python = environment == "python"
    plugin = python_tool(rollout.python_tool_isolation) if python else environment_factory(environment)
    return lambda: LocalEnvironment(plugin(), timeout_s)
