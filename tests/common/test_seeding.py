"""Reproducible sampling (train.deterministic): the seed rule, and its way from the episode loop through the turn
batcher to the engine, turn by turn."""

import asyncio

import numpy as np
import pytest

from services.common.config import SamplingConfig
from services.common.episodes.environments import Calculator, Task
from services.common.episodes.generation import Generation
from services.common.episodes.observations import VerbatimObservations
from services.common.episodes.runner import EpisodeLimits, LocalEnvironment, run_episodes, start_episodes
from services.common.episodes.turns import TurnBatcher
from services.common.seeding import sampling_seed

pytestmark = pytest.mark.unit

LIMITS = EpisodeLimits(
    max_turns=3, max_tokens_per_turn=40, max_total_tokens=200, max_observation_tokens=40, max_seq_len=400
)


class CharTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids if t)


def generation(text: str) -> Generation:
    ids = [ord(c) for c in text]
    return Generation(text, np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), "stop")


def test_a_samples_seed_is_a_fixed_function_of_the_run_seed_group_index_and_turn():
    seed = sampling_seed(0, "e0-i3", 1)
    assert seed == sampling_seed(0, "e0-i3", 1, turn=0)  # the same in every process: no salted hash()
    assert seed == 0x0C7D66DF30FC7D61  # pinned: a change to the rule changes every reproducible run's samples
    others = {
        sampling_seed(1, "e0-i3", 1),
        sampling_seed(0, "e0-i4", 1),
        sampling_seed(0, "e1-i3", 1),
        sampling_seed(0, "e0-i3", 0),
        sampling_seed(0, "e0-i3", 2),
        sampling_seed(0, "e0-i3", 1, turn=1),
    }
    assert seed not in others and len(others) == 6
    # Neighbours draw from unrelated streams, not seed, seed + 1, ... (which vLLM gives a request of n samples).
    assert abs(sampling_seed(0, "e0-i3", 1) - sampling_seed(0, "e0-i3", 0)) > 2**20
    assert all(
        0 <= sampling_seed(s, f"e0-i{g}", i) < 2**63 for s in (-5, 0, 2**40) for g in range(20) for i in range(8)
    )


class SeedRecordingEngine:
    """Answers each turn with a calculator call first, then a final answer; records the seeds of every call."""

    def __init__(self) -> None:
        self.seeds: list[list[int] | None] = []

    async def turns(self, contexts, max_tokens, sampling, seeds=None) -> list[Generation]:
        self.seeds.append(seeds)
        await asyncio.sleep(0.02)  # busy: turns asked for meanwhile wait for the next call
        return [generation("<calc>1+1</calc>" if "result" not in "".join(map(chr, c)) else "2\0") for c in contexts]


def play(run_seed: int | None, engine: SeedRecordingEngine) -> None:
    tokenizer = CharTokenizer()
    batcher = TurnBatcher(engine.turns)
    sampling = SamplingConfig(group_size=2)

    async def episodes() -> None:
        [group] = await start_episodes(
            [Task("p0", "Q: 1+1=", "2")], lambda: LocalEnvironment(Calculator(), 5.0), 2, tokenizer
        )
        for index, episode in enumerate(group):
            episode.sample = ("e0-i7", index)

        async def generate(contexts, max_tokens, seeds=None):
            return await batcher.generate(contexts, max_tokens, sampling, seeds)

        await run_episodes(group, generate, LIMITS, tokenizer, VerbatimObservations(tokenizer), run_seed=run_seed)

    asyncio.run(episodes())


def test_each_turn_of_a_seeded_episode_reaches_the_engine_with_its_own_seed_for_that_turn():
    engine = SeedRecordingEngine()
    play(11, engine)
    # How turns share calls depends on when each episode's tool answers; which seed each turn carries does not.
    asked = [seed for seeds in engine.seeds for seed in seeds or [None]]
    expected = [sampling_seed(11, "e0-i7", index, turn=turn) for turn in (0, 1) for index in (0, 1)]
    assert sorted(asked, key=str) == sorted(expected, key=str)
    assert engine.seeds[0] == expected[:2]  # the first turns are asked for together


def test_an_unseeded_episode_asks_the_engine_for_no_seeds():
    engine = SeedRecordingEngine()
    play(None, engine)
    assert engine.seeds == [None, None]


def test_a_shared_call_carries_each_batchs_seeds_beside_its_contexts_and_none_for_an_unseeded_batch():
    engine = SeedRecordingEngine()
    batcher = TurnBatcher(engine.turns)
    sampling = SamplingConfig()

    async def scenario() -> None:
        first = asyncio.create_task(batcher.generate([[65]], [4], sampling, [7]))
        await asyncio.sleep(0)  # the engine is now on the first call; the next two share the second
        await asyncio.gather(
            first,
            batcher.generate([[66], [67]], [4, 4], sampling, [8, 9]),
            batcher.generate([[68]], [4], sampling),
        )

    asyncio.run(scenario())
    assert engine.seeds == [[7], [8, 9, None]]
