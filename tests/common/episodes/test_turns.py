"""TurnBatcher: the turns of every batch in hand share the engine's calls; each batch gets its own answers, and a
failure or an abandoned batch costs no other batch anything."""

import asyncio

import numpy as np
import pytest

from services.common.config import SamplingConfig
from services.common.episodes.generation import Generation
from services.common.episodes.turns import TurnBatcher

pytestmark = pytest.mark.unit


def run(coroutine):
    return asyncio.run(coroutine)


def generation(token: int) -> Generation:
    return Generation(
        text=chr(token),
        token_ids=np.asarray([token], np.int32),
        logprobs=np.zeros(1, np.float32),
        finish_reason="length",
    )


class CountingEngine:
    """Answers each context with its own first token; raises for a context that starts with ``bad``."""

    def __init__(self, bad: int | None = None):
        self.bad = bad
        self.calls: list[tuple[list[int], float]] = []

    async def turns(self, contexts: list[list[int]], max_tokens: list[int], sampling: SamplingConfig):
        self.calls.append(([c[0] for c in contexts], sampling.temperature))
        await asyncio.sleep(0.05)  # the engine is busy: asks made meanwhile wait for the next call
        if any(c[0] == self.bad for c in contexts):
            raise ValueError("a context the engine refuses")
        return [generation(c[0]) for c in contexts]


def test_turns_asked_while_the_engine_is_busy_go_together_into_its_next_call_and_each_gets_its_own_answers():
    engine = CountingEngine()
    batcher = TurnBatcher(engine.turns)
    sampling = SamplingConfig()

    async def scenario() -> list[list[int]]:
        first = asyncio.create_task(batcher.generate([[1]], [4], sampling))
        await asyncio.sleep(0.01)  # the engine is now on the first call
        later = [asyncio.create_task(batcher.generate([[t], [t + 1]], [4, 4], sampling)) for t in (10, 20)]
        answers = await asyncio.gather(first, *later)
        return [[int(g.token_ids[0]) for g in answer] for answer in answers]

    assert run(scenario()) == [[1], [10, 11], [20, 21]]
    assert engine.calls == [([1], 1.0), ([10, 11, 20, 21], 1.0)]


def test_turns_sampled_differently_take_separate_calls():
    engine = CountingEngine()
    batcher = TurnBatcher(engine.turns)

    async def scenario() -> None:
        await asyncio.gather(
            batcher.generate([[1]], [4], SamplingConfig(temperature=1.0)),
            batcher.generate([[2]], [4], SamplingConfig(temperature=0.5)),
            batcher.generate([[3]], [4], SamplingConfig(temperature=1.0)),
        )

    run(scenario())
    assert engine.calls == [([1, 3], 1.0), ([2], 0.5)]


def test_a_shared_call_that_fails_is_tried_per_batch_so_only_the_batch_at_fault_gets_the_error():
    engine = CountingEngine(bad=7)
    batcher = TurnBatcher(engine.turns)
    sampling = SamplingConfig()

    async def scenario() -> list[object]:
        return await asyncio.gather(
            batcher.generate([[7]], [4], sampling), batcher.generate([[8]], [4], sampling), return_exceptions=True
        )

    failed, served = run(scenario())
    assert isinstance(failed, ValueError)
    assert [int(g.token_ids[0]) for g in served] == [8]
    assert engine.calls == [([7, 8], 1.0), ([7], 1.0), ([8], 1.0)]


def test_an_abandoned_batchs_turns_are_dropped_and_the_others_still_served():
    engine = CountingEngine()
    batcher = TurnBatcher(engine.turns)
    sampling = SamplingConfig()

    async def scenario() -> list[int]:
        first = asyncio.create_task(batcher.generate([[1]], [4], sampling))
        await asyncio.sleep(0.01)
        abandoned = asyncio.create_task(batcher.generate([[2]], [4], sampling))
        kept = asyncio.create_task(batcher.generate([[3]], [4], sampling))
        await asyncio.sleep(0)
        abandoned.cancel()  # the stage gave up on its batch (nats.max_work_s) while it waited for the engine
        await first
        return [int(g.token_ids[0]) for g in await kept]

    assert run(scenario()) == [3]
    assert engine.calls == [([1], 1.0), ([3], 1.0)]
