"""The sample archive alone: per-step files of the applied groups, their summaries, the bound and rollbacks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.common.transport.messages import Completion, ExperienceGroup
from services.trainer.intake.samples import SampleArchive, summarize

pytestmark = pytest.mark.unit


def group(group_id: str, rewards: list[float], logprobs: list[list[float]], ref: list[list[float]]) -> ExperienceGroup:
    completions = [
        Completion(
            text=f"c{i}",
            token_ids=np.arange(len(lp), dtype=np.int64),
            logprobs=np.array(lp, dtype=np.float32),
            finish_reason="stop" if i % 2 == 0 else "length",
        )
        for i, lp in enumerate(logprobs)
    ]
    return ExperienceGroup(
        group_id=group_id,
        prompt_id=f"p-{group_id}",
        prompt="1+2=",
        answer="3",
        prompt_ids=np.array([1, 2], dtype=np.int64),
        policy_version=7,
        completions=completions,
        rewards=np.array(rewards, dtype=np.float32),
        ref_logprobs=[np.array(r, dtype=np.float32) for r in ref],
    )


def test_summary_carries_rewards_and_per_token_logprob_and_kl_statistics():
    applied = group("g1", [1.0, 0.0], [[-0.5, -1.5], []], [[-1.0, -1.0], []])
    sample = summarize(3, applied)
    assert (sample.step, sample.group_id, sample.policy_version, sample.prompt) == (3, "g1", 7, "1+2=")
    first, empty = sample.completions
    assert (first.reward, first.finish_reason, first.tokens) == (1.0, "stop", 2)
    assert first.logprob_mean == -1.0 and first.logprob_min == -1.5
    assert first.kl_mean == 0.0 and first.kl_max == 0.5  # log ratios +0.5 and -0.5
    assert (empty.tokens, empty.logprob_mean, empty.kl_max, empty.finish_reason) == (0, 0.0, 0.0, "length")
    assert sample.reward_mean == 0.5


def test_an_empty_completion_between_two_others_leaves_their_statistics_their_own():
    applied = group("g1", [1.0, 0.0, 1.0], [[-0.5, -1.5], [], [-2.0, -4.0, -3.0]], [[-1.0, -1.0], [], [-2.0] * 3])
    first, empty, last = summarize(3, applied).completions
    assert (first.tokens, first.logprob_mean, first.logprob_min, first.kl_max) == (2, -1.0, -1.5, 0.5)
    assert (empty.tokens, empty.logprob_mean, empty.logprob_min, empty.kl_mean, empty.kl_max) == (0, 0.0, 0.0, 0.0, 0.0)
    assert (last.tokens, last.logprob_mean, last.logprob_min) == (3, -3.0, -4.0)
    assert (last.kl_mean, last.kl_max) == (-1.0, 0.0)  # log ratios 0, -2 and -1


def test_an_episodes_observation_tokens_are_in_no_statistic_and_the_mask_shows_where_they_are():
    # Model tokens 0-1 and 5, a tool's output at 2-4: its logprobs are 0 by convention and its reference logprobs
    # whatever the reference makes of text the model never chose, far from 0.
    applied = group(
        "g1", [1.0, 1.0], [[-0.5, -1.5, 0.0, 0.0, 0.0, -1.0], [-2.0]], [[-1.0, -1.0, -9, -9, -9, -1.0], [-2.0]]
    )
    applied.completions[0].loss_mask = np.array([1, 1, 0, 0, 0, 1], dtype=np.int8)
    episode, plain = summarize(3, applied).completions
    assert (episode.tokens, episode.observation_tokens, episode.mask) == (3, 3, "M2 O3 M1")
    assert episode.logprob_mean == -1.0 and episode.logprob_min == -1.5
    assert episode.kl_mean == 0.0 and episode.kl_max == 0.5  # log ratios +0.5, -0.5 and 0; the tool's 9s left out
    assert (plain.tokens, plain.observation_tokens, plain.mask) == (1, 0, "")


def test_a_step_reads_back_exactly_the_groups_recorded(tmp_path):
    archive = SampleArchive(tmp_path / "samples", keep_steps=5)
    applied = [
        group("a", [1.0, 0.0], [[-0.1], [-2.0]], [[-0.2], [-2.0]]),
        group("b", [0.0, 0.0], [[-1.0], [-1.0]], [[-1.0], [-1.0]]),
    ]
    archive.record(1, applied)
    read = archive.read(1)
    assert [g.group_id for g in read] == ["a", "b"]
    assert [[c.reward for c in g.completions] for g in read] == [[1.0, 0.0], [0.0, 0.0]]
    assert math.isclose(read[0].completions[0].kl_mean, 0.1, rel_tol=1e-5)
    assert read == [summarize(1, g) for g in applied]


def test_only_the_newest_keep_steps_steps_stay(tmp_path):
    archive = SampleArchive(tmp_path / "samples", keep_steps=3)
    for step in range(1, 7):
        archive.record(step, [group(f"g{step}", [1.0], [[-1.0]], [[-1.0]])])
    assert archive.steps() == [4, 5, 6]
    with pytest.raises(FileNotFoundError):
        archive.read(3)


def test_after_a_rollback_the_abandoned_branch_steps_are_dropped_and_the_step_replaced(tmp_path):
    archive = SampleArchive(tmp_path / "samples", keep_steps=10)
    for step in range(1, 6):
        archive.record(step, [group(f"old{step}", [0.0], [[-1.0]], [[-1.0]])])
    archive.record(3, [group("new3", [1.0], [[-1.0]], [[-1.0]])])  # rolled back to step 2, trained step 3 again
    assert archive.steps() == [1, 2, 3]
    assert [g.group_id for g in archive.read(3)] == ["new3"]


def test_keep_steps_zero_writes_nothing(tmp_path):
    archive = SampleArchive(tmp_path / "samples", keep_steps=0)
    archive.record(1, [group("g", [1.0], [[-1.0]], [[-1.0]])])
    assert archive.steps() == []
    assert not (tmp_path / "samples").exists()
