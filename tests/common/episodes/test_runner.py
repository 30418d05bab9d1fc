"""The episode loop over a deterministic engine stub and a character tokenizer: token in,
token out with masks and logprobs, continuous batching past a slow tool, and every bad environment ending its
episode with a named outcome instead of failing the batch."""

import asyncio
import time

import numpy as np
import pytest

from services.common.config import SamplingConfig
from services.common.episodes.environments import Calculator, EnvironmentFailed, StepResult, Task, Turn
from services.common.episodes.episode_environment import LocalEnvironment
from services.common.episodes.episode_state import EpisodeLimits, EpisodeState
from services.common.episodes.generation import Generation
from services.common.episodes.observations import ChatObservations, VerbatimObservations
from services.common.episodes.runner import run_episodes, start_episodes
from services.common.episodes.turns import TurnBatcher
from services.common.transport.breaker import DependencyUnavailable
from tests.support.episodes import EOS, LIMITS, MERGED, SAMPLED_LOGPROB, CharTokenizer, ScriptedEngine

pytestmark = pytest.mark.unit


async def episodes_of(environment, samples: int = 1, prompt: str = "Q: 123*456=") -> list[EpisodeState]:
    [group] = await start_episodes([Task("p0", prompt, "56088")], lambda: environment, samples, CharTokenizer())
    return group


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_tool_episode_keeps_the_models_tokens_masked_in_and_the_tools_masked_out():
    tokenizer = CharTokenizer()
    engine = ScriptedEngine(["I'll compute: <calc>123*456</calc>", "The answer is 56088.\0"], tokenizer)

    async def episode() -> EpisodeState:
        [[state]] = await start_episodes(
            [Task("p0", "Q: 123*456=", "56088")], lambda: LocalEnvironment(Calculator(), 5.0), 1, tokenizer
        )
        await run_episodes([state], engine.generate, LIMITS, tokenizer, VerbatimObservations(tokenizer))
        return state

    state = run(episode())
    completion = state.completion(tokenizer)
    model_1, tool, model_2 = "I'll compute: <calc>123*456</calc>", "<result>56088</result>", "The answer is 56088."
    assert completion.text == model_1 + tool + model_2
    expected_mask = [1] * len(model_1) + [0] * len(tool) + [1] * (len(model_2) + 1)  # + the EOS token
    assert completion.loss_mask.tolist() == expected_mask
    assert completion.logprobs.tolist() == [SAMPLED_LOGPROB if m else 0.0 for m in expected_mask]
    assert completion.episode.model_dump(exclude={"env_seconds"}) == {
        "turns": 2,
        "tool_calls": 1,
        "tool_errors": 0,
        "env_reward": 0.0,
        "outcome": "done",
    }
    assert completion.finish_reason == "stop"


def test_earlier_turns_are_never_re_tokenized():
    tokenizer = CharTokenizer()
    engine = ScriptedEngine(["\1<calc>2*3</calc>", "\1 6\0"], tokenizer)  # each turn starts with the merged token

    async def episode() -> EpisodeState:
        [[state]] = await start_episodes(
            [Task("p0", "Q", "6")], lambda: LocalEnvironment(Calculator(), 5.0), 1, tokenizer
        )
        await run_episodes([state], engine.generate, LIMITS, tokenizer, VerbatimObservations(tokenizer))
        return state

    state = run(episode())
    # The second call continues the first turn's exact ids, the merged token included.
    assert engine.calls[1][0][1:2] == [MERGED]
    assert state.context[1:].count(MERGED) == 2
    # Encoded: the prompt once and the one observation once, nothing the model wrote.
    assert tokenizer.encoded == ["Q", "<result>6</result>"]


class SlowOnce:
    """A tool that takes ``delay_s`` on its first step, then answers at once; ends the episode on a turn without
    a call, as the calculator does."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    async def reset(self, task: Task) -> str:
        return task.prompt

    async def step(self, turn: Turn) -> StepResult:
        if "<calc>" not in turn.text:
            return StepResult(done=True)
        await asyncio.sleep(self.delay_s)
        self.delay_s = 0.0
        return StepResult(observation="<result>1</result>", tool_call=True)

    async def close(self) -> None:
        pass


def test_an_episode_waiting_on_its_tool_does_not_hold_the_others_turns():
    tokenizer = CharTokenizer()
    engine = ScriptedEngine(["<calc>1</calc>", "<calc>1</calc>", "done\0"], tokenizer)
    slow, fast = SlowOnce(1.0), SlowOnce(0.0)
    environments = iter([slow, fast])

    async def both() -> list[EpisodeState]:
        [group] = await start_episodes([Task("p0", "Q", "1")], lambda: next(environments), 2, tokenizer)
        await run_episodes(group, engine.generate, LIMITS, tokenizer, VerbatimObservations(tokenizer))
        return group

    group = run(both())
    # The first call holds both; the fast episode's next two turns go alone while the slow one's tool works.
    assert [len(call) for call in engine.calls] == [2, 1, 1, 1, 1]
    assert [state.outcome for state in group] == ["done", "done"]
    assert [state.turns for state in group] == [3, 3]


def test_two_batches_in_hand_share_the_engines_calls_and_the_second_ends_while_the_firsts_tool_still_works():
    tokenizer = CharTokenizer()
    engine = ScriptedEngine(["<calc>1</calc>", "done\0"], tokenizer)
    sampling = SamplingConfig(group_size=2)
    batcher = TurnBatcher(lambda contexts, max_tokens, _: engine.generate(contexts, max_tokens))
    ended: list[str] = []

    async def batch(name: str, delay_s: float) -> list[EpisodeState]:
        [group] = await start_episodes([Task(name, "Q", "1")], lambda: SlowOnce(delay_s), 2, tokenizer)

        async def generate(contexts: list[list[int]], max_tokens: list[int]) -> list[Generation]:
            return await batcher.generate(contexts, max_tokens, sampling)

        await run_episodes(group, generate, LIMITS, tokenizer, VerbatimObservations(tokenizer))
        ended.append(name)
        return group

    async def both() -> tuple[list[EpisodeState], list[EpisodeState]]:
        return await asyncio.gather(batch("slow", 1.0), batch("fast", 0.0))

    slow, fast = run(both())
    # One call takes both batches' first turns; the fast batch's second turns go while the slow tool works, and
    # the fast batch ends first; the slow batch's second turns take a call of their own.
    assert [len(call) for call in engine.calls] == [4, 2, 2]
    assert ended == ["fast", "slow"]
    assert batcher.calls == 3
    assert [state.outcome for state in slow + fast] == ["done"] * 4


class Raises:
    def reset(self, task: Task) -> str:
        return task.prompt

    def step(self, turn: Turn) -> StepResult:
        raise RuntimeError("the tool's own bug")


class Hangs(Raises):
    def step(self, turn: Turn) -> StepResult:
        time.sleep(1.0)  # the hanging tool under test: longer than the step timeout it is given
        return StepResult(observation="late")


class Floods(Raises):
    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation="x" * 41, tool_call=True)


class NeverDone(Raises):
    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation="<result>go on</result>", tool_call=True)


class ReturnsNonsense(Raises):
    def step(self, turn: Turn) -> dict:
        return {"observation": "not a StepResult"}


class ReturnsNoObservation(Raises):
    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation=None)  # a StepResult whose fields are off the schema


class ReturnsNumpy(Raises):
    def step(self, turn: Turn) -> StepResult:
        return StepResult(reward_part=np.float32(0.5), done=np.bool_(True), tool_call=np.bool_(False))


def test_a_plugin_may_answer_with_numpy_numbers_and_booleans():
    tokenizer = CharTokenizer()

    async def episode() -> EpisodeState:
        [[state]] = await start_episodes(
            [Task("p0", "Q", "2")], lambda: LocalEnvironment(ReturnsNumpy(), 1.0), 1, tokenizer
        )
        await run_episodes(
            [state], ScriptedEngine(["2"], tokenizer).generate, LIMITS, tokenizer, VerbatimObservations(tokenizer)
        )
        return state

    state = run(episode())
    assert (state.outcome, state.env_reward, type(state.env_reward)) == ("done", 0.5, float)
    assert state.completion(tokenizer).episode.env_reward == 0.5  # what the reward role weighs as 'environment'


class ClosesCounted(Raises):
    """An episode environment (async) whose second reset fails; counts the closes it is sent."""

    resets = 0
    closed = 0

    async def reset(self, task: Task) -> str:
        ClosesCounted.resets += 1
        if ClosesCounted.resets == 2:
            raise EnvironmentFailed("env_error", "the second reset fails")
        return task.prompt

    async def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)

    async def close(self) -> None:
        ClosesCounted.closed += 1


def test_a_held_batch_closes_the_episodes_that_did_reset():
    with pytest.raises(DependencyUnavailable, match="the second reset fails"):
        run(start_episodes([Task("p0", "Q", "")], ClosesCounted, 3, CharTokenizer()))
    assert (ClosesCounted.resets, ClosesCounted.closed) == (3, 2)


class ReturnsNanReward(Raises):
    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation="<result>2</result>", reward_part=float("nan"))


@pytest.mark.parametrize(
    ("environment", "limits", "outcome", "turns"),
    [
        (Raises(), LIMITS, "env_error", 1),
        (ReturnsNonsense(), LIMITS, "env_error", 1),
        (ReturnsNoObservation(), LIMITS, "env_error", 1),
        (ReturnsNanReward(), LIMITS, "env_error", 1),
        (Hangs(), LIMITS, "timeout", 1),
        (Floods(), LIMITS, "truncated", 1),
        (NeverDone(), LIMITS, "max_turns", 4),
        (NeverDone(), EpisodeLimits(4, 10, 42, 40, 400), "max_tokens", 2),
    ],
)
def test_a_bad_environment_ends_the_episode_with_a_named_outcome(environment, limits, outcome, turns):
    tokenizer = CharTokenizer()
    engine = ScriptedEngine(["<calc>1+1</calc>"], tokenizer)

    async def episode() -> EpisodeState:
        [[state]] = await start_episodes(
            [Task("p0", "Q", "2")], lambda: LocalEnvironment(environment, 0.3), 1, tokenizer
        )
        await run_episodes([state], engine.generate, limits, tokenizer, VerbatimObservations(tokenizer))
        return state

    state = run(episode())
    completion = state.completion(tokenizer)  # a valid completion to train on, whatever went wrong
    assert (completion.episode.outcome, completion.episode.turns) == (outcome, turns)
    assert completion.finish_reason == ("length" if outcome in ("truncated", "max_turns", "max_tokens") else "stop")
    assert len(completion.token_ids) <= limits.max_total_tokens


def test_a_reset_that_fails_holds_the_batch_instead_of_failing_its_prompts():
    class ResetRaises(Raises):
        def reset(self, task: Task) -> str:
            raise ConnectionError("tool server gone")

    with pytest.raises(DependencyUnavailable, match="the environment's reset failed"):
        run(episodes_of(LocalEnvironment(ResetRaises(), 1.0)))


def test_episodes_of_one_prompt_whose_resets_disagree_hold_the_batch():
    class Counter(Raises):
        count = 0

        def reset(self, task: Task) -> str:
            Counter.count += 1
            return f"{task.prompt} #{Counter.count}"

    with pytest.raises(DependencyUnavailable, match="gave different prompts"):
        run(start_episodes([Task("p0", "Q", "")], lambda: LocalEnvironment(Counter(), 1.0), 2, CharTokenizer()))


OTHER_END = 2  # an end token of the model's generation config that is not the tokenizer's EOS


def test_a_turn_the_engine_ended_on_another_end_token_ends_a_verbatim_episode_as_its_eos_does():
    tokenizer = CharTokenizer()
    engine = ScriptedEngine(["answer 1\x02", "never asked"], tokenizer)

    async def play(end_tokens: frozenset[int] | None) -> EpisodeState:
        [[episode]] = await start_episodes([Task("p0", "Q", "1")], lambda: SlowOnce(0.0), 1, tokenizer)
        await run_episodes([episode], engine.generate, LIMITS, tokenizer, VerbatimObservations(tokenizer), end_tokens)
        return episode

    ended = run(play(frozenset({EOS, OTHER_END})))
    assert (ended.outcome, ended.turns) == ("done", 1)
    assert ended.context[-1] == OTHER_END


def test_in_chat_mode_a_turn_ended_on_another_end_token_gets_no_second_eos_before_the_observation():
    tokenizer = CharTokenizer()
    engine = ScriptedEngine(["<calc>1</calc>\x02", "done\x02"], tokenizer)
    chat = ChatObservations(tokenizer, EOS, before="[t]", after="[/t][a]")

    async def play() -> EpisodeState:
        [[episode]] = await start_episodes([Task("p0", "Q", "1")], lambda: SlowOnce(0.0), 1, tokenizer)
        await run_episodes([episode], engine.generate, LIMITS, tokenizer, chat, frozenset({EOS, OTHER_END}))
        return episode

    episode = run(play())
    first_turn = [ord(c) for c in "<calc>1</calc>"] + [OTHER_END]
    observation = [ord(c) for c in "[t]<result>1</result>[/t][a]"]
    assert episode.context[1 : 1 + len(first_turn) + len(observation)] == first_turn + observation
    assert EOS not in episode.context
    assert (episode.outcome, episode.turns) == ("done", 2)
