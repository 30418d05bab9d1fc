"""docs/agents.md's worked example, run as the docs print it: loaded by its import path as a
config names it, and driven through the episode loop to the right guess."""

import asyncio
import re
import sys

import numpy as np
import pytest

from services.common.config import RolloutConfig
from services.common.episodes.environments import Task, environment_factory
from services.common.episodes.episode_environment import LocalEnvironment
from services.common.episodes.generation import Generation
from services.common.episodes.observations import VerbatimObservations
from services.common.episodes.runner import run_episodes, start_episodes
from tests.support.episodes import LIMITS, CharTokenizer
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit


@pytest.fixture
def docs_plugin(tmp_path, monkeypatch) -> str:
    """The docs' example saved as my_envs.py on the Python path, as the docs tell the reader to."""
    docs = (ROOT / "docs" / "agents.md").read_text()
    [code] = re.findall(r"## A worked example.*?```python\n(.*?)```", docs, re.DOTALL)
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_envs:GuessTheNumber"
    sys.modules.pop("my_envs", None)


def test_the_docs_example_environment_runs_an_episode_to_the_right_guess(docs_plugin):
    assert RolloutConfig(environment=docs_plugin).environment == docs_plugin  # loads as the docs' config names it
    tokenizer = CharTokenizer()
    guesses = iter(["guess 50.", "guess 25.", "guess 37.", "guess 31."])

    async def engine(contexts: list[list[int]], max_tokens: list[int]) -> list[Generation]:
        ids = [ord(c) for c in next(guesses)]
        return [Generation(tokenizer.decode(ids), np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), "stop")]

    async def episode():
        make = environment_factory(docs_plugin)
        [[state]] = await start_episodes(
            [Task("p0", "Find the number: ", "31")], lambda: LocalEnvironment(make(), 1.0), 1, tokenizer
        )
        await run_episodes([state], engine, LIMITS, tokenizer, VerbatimObservations(tokenizer))
        return state

    state = asyncio.run(episode())
    completion = state.completion(tokenizer)
    assert completion.text == "guess 50. lower. guess 25. higher. guess 37. lower. guess 31."
    assert (completion.episode.outcome, completion.episode.turns, completion.episode.tool_calls) == ("done", 4, 4)
    assert state.env_reward == 1.0
