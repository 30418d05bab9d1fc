"""One engine call at a time for the multi-turn episodes of every batch a rollout replica has in hand.

The rollout stage may hold several batches at once (``rollout.episode_batches``, ``Stage.lanes``); each batch's
episode loop (``episodes.run_episodes``) asks for the turns of its ready episodes. ``TurnBatcher`` puts every turn
asked for while the engine is busy into its next call, so a batch whose last episodes wait on their environment
holds neither the engine nor the next batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.common.config import SamplingConfig
from services.common.episodes.generation import Generation


@dataclass
class _TurnRequest:
    contexts: list[list[int]]
    max_tokens: list[int]
    sampling: SamplingConfig
    answer: asyncio.Future[list[Generation]]
    seeds: list[int] | None = None  # each context's own sampling seed (train.deterministic); None: the shared stream


# (contexts, max new tokens for each, sampling[, seeds=each context's seed]) -> one turn each: one engine call. The
# seeds are passed only when some turn has one, so an engine that takes none serves unseeded runs.
EngineTurns = Callable[..., Awaitable[list[Generation]]]


class TurnBatcher:
    """One engine call at a time, each taking every turn asked for since the last began, of every batch in hand.

    A batch's ``generate`` waits while the engine serves a call; the turns asked for meanwhile, by it and by the
    other batches, go together into the next call (those sampled alike: a live sampling change between batches
    makes two calls). When a shared call fails, each batch's turns are tried alone, so one batch's bad context
    costs only its own deliveries; a batch whose compute was abandoned has its answer dropped."""

    def __init__(self, engine_turns: EngineTurns):
        self.engine_turns = engine_turns
        self.calls = 0  # engine calls made: fewer than the batches' requests when turns were shared
        self._waiting: list[_TurnRequest] = []
        self._serving: asyncio.Task[None] | None = None

    async def generate(
        self,
        contexts: list[list[int]],
        max_tokens: list[int],
        sampling: SamplingConfig,
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        """One turn for each of ``contexts``; with ``seeds``, each drawn with its own (a seeded sample does not
        depend on which other turns share its engine call)."""
        answer: asyncio.Future[list[Generation]] = asyncio.get_running_loop().create_future()
        self._waiting.append(_TurnRequest(contexts, max_tokens, sampling, answer, seeds))
        if self._serving is None or self._serving.done():
            self._serving = asyncio.create_task(self._serve())
        return await answer

    async def _serve(self) -> None:
        try:
            while self._waiting:
                sampling = self._waiting[0].sampling
                taken = [r for r in self._waiting if r.sampling == sampling and not r.answer.done()]
                self._waiting = [r for r in self._waiting if r.sampling != sampling and not r.answer.done()]
                if taken:
                    await self._call(taken, sampling)
        finally:  # cancelled with the rollout: nobody may wait for an answer that will not come
            for request in self._waiting:
                request.answer.cancel()

    async def _call(self, taken: list[_TurnRequest], sampling: SamplingConfig) -> None:
        contexts = [context for request in taken for context in request.contexts]
        max_tokens = [tokens for request in taken for tokens in request.max_tokens]
        seeded = any(request.seeds is not None for request in taken)
        seeds = [seed for request in taken for seed in request.seeds or [None] * len(request.contexts)]
        self.calls += 1
        try:
            if seeded:
                generations = await self.engine_turns(contexts, max_tokens, sampling, seeds=seeds)
            else:
                generations = await self.engine_turns(contexts, max_tokens, sampling)
        except asyncio.CancelledError:
            for request in taken:
                request.answer.cancel()
            raise
        except Exception as error:
            if len(taken) == 1:
                if not taken[0].answer.done():
                    taken[0].answer.set_exception(error)
                return
            for request in taken:  # whose turns failed it: each batch alone
                if not request.answer.done():
                    await self._call([request], sampling)
            return
        start = 0
        for request in taken:
            end = start + len(request.contexts)
            if not request.answer.done():
                request.answer.set_result(generations[start:end])
            start = end
