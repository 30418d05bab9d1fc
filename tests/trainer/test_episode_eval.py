"""The held-out evaluation of a multi-turn run on fakes: episodes played with the run's
environment through the rollout's loop, scored by reward.functions, with turns and tool calls beside accuracy."""

import asyncio
from dataclasses import replace

import pytest

from services.common.episodes.environments import Calculator, NoTool
from services.common.episodes.episode_environment import LocalEnvironment
from services.common.episodes.episode_state import EpisodeLimits
from services.common.episodes.observations import VerbatimObservations
from services.trainer.episode_eval import EpisodeEvaluation, RuleReward, play
from services.trainer.learning.distributed import Op
from services.trainer.learning.follower import evaluate_payload, follow
from tests.support.episodes import CharTokenizer, ScriptedEngine

pytestmark = pytest.mark.unit

LIMITS = EpisodeLimits(
    max_turns=3, max_tokens_per_turn=40, max_total_tokens=200, max_observation_tokens=80, max_seq_len=300
)
ROWS = [
    {"id": "right", "prompt": "123*456=", "answer": "56088"},
    {"id": "wrong", "prompt": "123*457=", "answer": "56211"},
]


def evaluate(script: list[str], environment, weights=None, rows=ROWS, environment_weight=0.0) -> EpisodeEvaluation:
    tokenizer = CharTokenizer()
    engine = ScriptedEngine(script, tokenizer)
    reward = RuleReward({"final_number": 1.0} if weights is None else weights, environment_weight)
    return asyncio.run(
        play(
            rows,
            lambda: LocalEnvironment(environment(), 5.0),
            engine.generate,
            LIMITS,
            tokenizer,
            VerbatimObservations(tokenizer),
            reward,
        )
    )


def test_a_tool_episode_is_right_when_its_answer_after_the_tools_result_is_the_rows_answer():
    # Both rows call the calculator with 123*456 and copy its result: right for the first row's answer only.
    result = evaluate(["<calc>123*456</calc>", "56088\0"], Calculator)

    assert result == EpisodeEvaluation(
        accuracy=0.5, reward_mean=0.5, turns_mean=2.0, tool_calls_mean=1.0, tool_errors_mean=0.0
    )
    assert result.metrics() == {
        "eval/reward_mean": 0.5,
        "eval/turns_mean": 2.0,
        "eval/tool_calls_mean": 1.0,
        "eval/tool_errors_mean": 0.0,
    }


def test_a_malformed_call_counts_as_a_tool_error_and_the_episode_goes_on_to_its_answer():
    result = evaluate(["<calc>123*</calc>", "<calc>123*456</calc>", "56088\0"], Calculator, rows=ROWS[:1])

    assert result == EpisodeEvaluation(
        accuracy=1.0, reward_mean=1.0, turns_mean=3.0, tool_calls_mean=2.0, tool_errors_mean=1.0
    )


def test_an_episode_that_runs_out_of_turns_without_answering_is_wrong():
    # Three turns of calls and never an answer: its last number is the call's 456, not the tool's 56088.
    result = evaluate(["<calc>123*456</calc>"], Calculator, rows=ROWS[:1])

    assert (result.turns_mean, result.tool_calls_mean, result.accuracy) == (3.0, 3.0, 0.0)


def test_without_the_tool_one_turn_holds_the_whole_transcript_and_its_invented_result():
    result = evaluate(["<calc>123*456</calc><result>56000</result>56000\0"], NoTool)

    assert result == EpisodeEvaluation(
        accuracy=0.0, reward_mean=0.0, turns_mean=1.0, tool_calls_mean=0.0, tool_errors_mean=0.0
    )


def test_right_means_a_positive_reward_so_a_penalty_can_outweigh_a_right_answer():
    reward = RuleReward({"final_number": 1.0, "length_penalty": 0.5})

    assert reward("= 42", "42", "stop") == 1.0 and reward.right(1.0)
    assert reward("= 42", "42", "length") == 0.5 and reward.right(0.5)
    assert reward("= 41", "42", "stop") == 0.0 and not reward.right(0.0)
    assert RuleReward({"final_number": 1.0, "length_penalty": 1.0})("= 42", "42", "length") == 0.0


@pytest.mark.parametrize("weights", [{}, {"final_number": 0.0, "length_penalty": -1.0}])
def test_reward_functions_without_a_positive_weight_are_refused_naming_the_fields(weights):
    with pytest.raises(ValueError, match=r"reward.functions.*data.eval_path empty"):
        RuleReward(weights)


def test_no_rows_is_an_error_not_an_accuracy():
    with pytest.raises(ValueError, match="at least one row"):
        evaluate(["1\0"], Calculator, rows=[])


class ScriptedMesh:
    def __init__(self, commands):
        self.commands = list(commands)

    def receive(self):
        return self.commands.pop(0)


class RecordingReplica:
    def __init__(self):
        self.calls = []

    def evaluate(self, rows, max_new_tokens):
        self.calls.append(("evaluate", rows, max_new_tokens))

    def evaluate_episodes(self, rows):
        self.calls.append(("evaluate_episodes", rows))


def test_a_follower_rank_plays_the_episodes_when_the_leader_evaluates_episodes_and_greedy_rows_otherwise():
    rows = [{"prompt": "1+1=", "answer": "2"}]
    mesh = ScriptedMesh(
        [
            (Op.EVALUATE, evaluate_payload(rows, 0, episodes=True)),
            (Op.EVALUATE, evaluate_payload(rows, 6)),
            (Op.STOP, b""),
        ]
    )
    replica = RecordingReplica()

    follow(mesh, replica)

    assert replica.calls == [("evaluate_episodes", rows), ("evaluate", rows, 6)]


class PaysForCalls(Calculator):
    """The calculator, whose every answered call earns the episode an environment reward of 1."""

    def step(self, turn):
        result = super().step(turn)
        return replace(result, reward_part=float(result.tool_call and not result.tool_error))


def test_the_environments_own_reward_counts_with_its_weight_in_the_held_out_reward():
    # The second row's answer is wrong, but both episodes made one good call: 0.5 each from the environment.
    script = ["<calc>123*456</calc>", "56088\0"]
    result = evaluate(script, PaysForCalls, weights={"final_number": 1.0}, environment_weight=0.5)
    assert (result.accuracy, result.reward_mean) == (1.0, 1.0)  # (1 + 0.5) and (0 + 0.5): both positive
    assert evaluate(script, PaysForCalls).reward_mean == 0.5  # weight 0: reported only
    assert evaluate(script, PaysForCalls, weights={}, environment_weight=1.0).reward_mean == 1.0
