"""Per-step statistics of multi-turn episodes: the agent/... keys of a step row, exported and alertable."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.config import AlertRule, default_alert_rules
from services.common.observe import metrics as m
from services.common.observe.metrics import TRAINER_STEP_KEYS, check_row
from services.common.transport.messages import Completion, Episode, ExperienceGroup
from services.trainer.alerts import AlertEvaluator
from services.trainer.intake.episode_stats import OUTCOMES, episode_metrics

pytestmark = pytest.mark.unit


def group(episodes: list[Episode | None]) -> ExperienceGroup:
    ids = np.asarray([3, 4], np.int32)
    return ExperienceGroup(
        group_id="g",
        prompt_id="p",
        prompt="q",
        prompt_ids=ids,
        policy_version=0,
        completions=[
            Completion(text="x", token_ids=ids, logprobs=np.zeros(2, np.float32), finish_reason="stop", episode=e)
            for e in episodes
        ],
        rewards=np.zeros(len(episodes), np.float32),
        ref_logprobs=[np.zeros(2, np.float32)] * len(episodes),
    )


def episode(turns: int, tool_calls: int, tool_errors: int, env_seconds: float, outcome: str) -> Episode:
    return Episode(
        turns=turns, tool_calls=tool_calls, tool_errors=tool_errors, env_seconds=env_seconds, outcome=outcome
    )


def test_episode_metrics_are_means_over_the_episodes_and_the_share_of_each_outcome_by_hand():
    first = group([episode(3, 2, 0, 1.0, "done"), episode(1, 0, 0, 0.0, "done")])
    # A single-turn completion in the batch is no episode and counts in none of the means.
    second = group([episode(4, 4, 2, 2.0, "env_error"), None, episode(2, 1, 1, 0.5, "max_turns")])
    assert episode_metrics([first, second]) == {
        "agent/turns_mean": 2.5,
        "agent/tool_calls_mean": 1.75,
        "agent/tool_errors_mean": 0.75,
        "agent/env_seconds_mean": 0.875,
        "agent/outcome/done": 0.5,
        "agent/outcome/max_turns": 0.25,
        "agent/outcome/max_tokens": 0.0,
        "agent/outcome/env_error": 0.25,
        "agent/outcome/timeout": 0.0,
        "agent/outcome/truncated": 0.0,
    }


def test_a_batch_without_episodes_adds_no_agent_keys():
    assert episode_metrics([group([None, None])]) == {}


def test_every_agent_key_is_declared_in_the_metrics_contract_and_a_prometheus_gauge_of_the_trainer():
    keys = episode_metrics([group([episode(1, 0, 0, 0.0, "done")])])
    check_row(keys)
    assert set(keys) <= set(TRAINER_STEP_KEYS)
    # The contract's closed family of outcomes is exactly the outcomes an episode may end with.
    assert m.EPISODE_OUTCOMES == OUTCOMES


def test_the_episodes_of_groups_dynamic_sampling_left_out_count_in_the_agent_metrics():
    # A group whose every episode failed scores all alike and is filtered: its failures still show.
    trained = group([episode(2, 1, 0, 0.1, "done")] * 2)
    failed = [episode(1, 1, 1, 0.1, "env_error")] * 6
    row = episode_metrics([trained], failed)
    assert row["agent/outcome/env_error"] == 6 / 8 and row["agent/outcome/done"] == 2 / 8
    assert row["agent/turns_mean"] == (2 * 2 + 6 * 1) / 8
    assert episode_metrics([trained])["agent/outcome/env_error"] == 0.0


def test_the_default_rules_alert_when_most_episodes_end_in_environment_errors_for_three_steps():
    evaluator = AlertEvaluator(default_alert_rules(), cooldown_steps=0, now=0.0)
    healthy = group([episode(2, 1, 0, 0.1, "done")] * 2)
    failing = group([episode(1, 1, 1, 0.1, "env_error"), episode(1, 1, 1, 0.1, "timeout")] * 2)
    timing_out = group([episode(1, 1, 0, 5.0, "timeout")] * 2)
    fired = [
        [f.rule for f in evaluator.observe({"step": step, **episode_metrics([batch])}, now=float(step))]
        for step, batch in enumerate([healthy, failing, failing, healthy, *[timing_out] * 3], start=1)
    ]
    # Half of them env_error is not over half; three steps of all-timeout are.
    assert fired == [[], [], [], [], [], [], ["environment_timeouts"]]
    evaluator = AlertEvaluator(default_alert_rules(), cooldown_steps=0, now=0.0)
    erring = group([episode(1, 1, 1, 0.1, "env_error")] * 2)
    fired = [
        [f.rule for f in evaluator.observe({"step": step, **episode_metrics([erring])}, now=float(step))]
        for step in range(1, 4)
    ]
    assert fired == [[], [], ["environment_errors"]]


def test_an_alert_rule_on_an_episode_outcome_fires_from_the_step_rows():
    rule = AlertRule(name="env_failing", metric="agent/outcome/env_error", condition="above", threshold=0.5)
    evaluator = AlertEvaluator([rule], cooldown_steps=0, now=0.0)
    healthy = group([episode(2, 1, 0, 0.1, "done")] * 2)
    failing = group([episode(1, 1, 1, 0.1, "env_error")] * 2)
    fired = [
        evaluator.observe({"step": step, **episode_metrics([batch])}, now=float(step))
        for step, batch in enumerate([healthy, failing], start=1)
    ]
    assert [len(firings) for firings in fired] == [0, 1]
    assert fired[1][0].metric == "agent/outcome/env_error" and fired[1][0].value == 1.0
