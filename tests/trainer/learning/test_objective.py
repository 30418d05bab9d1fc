"""The step's objective on hand-made batches: no model, no learner (``services/trainer/learning/objective.py``)."""

import math

import numpy as np
import pytest
import torch

from services.common.config.training import OffPolicyConfig, TrainConfig
from services.common.model.modeling import pack, token_logprobs
from services.common.observe import metrics as m
from services.common.observe.metrics import check_row
from services.common.transport.messages import Completion
from services.trainer.learning import objective
from services.trainer.learning.algorithms import group_advantages, policy_loss, value_loss
from services.trainer.learning.batch import Batch, StepTargets
from services.trainer.learning.corrections import correction_weights, log_ratio
from tests.support.messages import completion as sampled
from tests.support.messages import experience_group

pytestmark = pytest.mark.unit


def hand_batch() -> Batch:
    """Two groups of two completions, three response tokens wide; the last row ended after two tokens."""
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
    pairs = [([1, 2], [3, 4, 5]), ([1, 2], [6, 7, 8]), ([9], [3, 3, 4]), ([9], [5, 6])]
    return Batch(
        pairs=pairs,
        mask=mask,
        filled=mask.clone(),
        rollout_logp=torch.full((4, 3), -1.0) * mask,
        ref_logp=torch.full((4, 3), -1.5) * mask,
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        group_index=torch.tensor([0, 0, 1, 1]),
        stopped=torch.tensor([0.0, 0.0, 0.0, 1.0]),
        policy_versions=torch.tensor([3.0, 3.0, 5.0, 5.0]),
        token_versions=torch.tensor([[3.0, 3, 3], [3, 3, 3], [5, 5, 5], [5, 5, 0]]),
    )


def test_kl_in_the_reward_is_subtracted_per_token_before_the_group_baseline():
    train = TrainConfig(algorithm="grpo", kl={"coef": 1.0, "in": "reward", "estimator": "k1"})
    batch = hand_batch()
    old_logp = batch.ref_logp + 0.5 * batch.mask  # the policy drifted up by 0.5 nats on every token
    advantages, returns = objective.advantages(train, batch, old_logp, None)
    expected = group_advantages(batch.rewards - 0.5 * batch.mask.sum(-1), batch.group_index, "grpo")
    torch.testing.assert_close(advantages, expected[:, None] * batch.mask)
    assert returns is None


def test_dr_grpo_takes_the_group_mean_without_dividing_by_the_std():
    train = TrainConfig(algorithm="dr_grpo", kl={"coef": 0.0})
    batch = hand_batch()
    advantages, _ = objective.advantages(train, batch, batch.rollout_logp, None)
    # Group 0 scores 1 and 0 (mean 0.5); group 1 scores 1 and 1 (no signal).
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))


def packed_and_logits(batch: Batch, rows: torch.Tensor) -> tuple:
    packed = pack([batch.pairs[i] for i in rows.tolist()], pad_id=0)
    logits = torch.randn(len(rows), packed.mask.shape[1], 10, generator=torch.Generator().manual_seed(0))
    return packed, logits


def test_the_loss_adds_the_kl_term_only_where_placed_in_the_loss():
    batch = hand_batch()
    rows = torch.tensor([0, 3])
    packed, logits = packed_and_logits(batch, rows)
    targets = StepTargets(old_logp=batch.rollout_logp, advantages=torch.ones_like(batch.mask) * batch.mask)
    in_loss = TrainConfig(kl={"coef": 0.25, "in": "loss", "estimator": "k3"})
    in_reward = TrainConfig(kl={"coef": 0.25, "in": "reward", "estimator": "k3"})
    loss, stats = objective.micro_batch_loss(in_loss, batch, rows, packed, logits, None, targets, False)
    plain, plain_stats = objective.micro_batch_loss(in_reward, batch, rows, packed, logits, None, targets, False)
    torch.testing.assert_close(stats["kl_ref"], plain_stats["kl_ref"])
    assert float(stats["kl_ref"]) > 0
    torch.testing.assert_close(loss, plain + 0.25 * stats["kl_ref"])
    torch.testing.assert_close(plain, plain_stats["pg_loss"])  # no entropy bonus by default
    # The pg loss is the clipped surrogate over these rows' tokens only (the short row's padding masked).
    mask = batch.mask[rows, : packed.mask.shape[1]]
    expected, _ = policy_loss(
        token_logprobs(logits, packed.targets),
        batch.rollout_logp[rows],
        targets.advantages[rows],
        mask,
        0.2,
        0.2,
        None,
        "token-mean",
        horizon=3,
    )
    torch.testing.assert_close(plain_stats["pg_loss"], expected)


def test_during_the_critic_warm_up_only_the_value_loss_is_trained():
    batch = hand_batch()
    rows = torch.tensor([1, 2])
    packed, logits = packed_and_logits(batch, rows)
    values = torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.1, 0.4]], requires_grad=True)
    targets = StepTargets(
        old_logp=batch.rollout_logp,
        advantages=batch.mask.clone(),
        old_values=torch.zeros_like(batch.mask),
        returns=torch.ones_like(batch.mask),
    )
    train = TrainConfig(algorithm="ppo", critic={"value_coef": 0.5})
    warm, stats = objective.micro_batch_loss(train, batch, rows, packed, logits, values, targets, True)
    clip = train.critic.value_clip
    v_loss, _ = value_loss(
        values, targets.old_values[rows], targets.returns[rows], batch.mask[rows], clip, "token-mean", 3
    )
    torch.testing.assert_close(warm, 0.5 * v_loss)
    torch.testing.assert_close(stats["value_loss"], v_loss.detach())
    full, _ = objective.micro_batch_loss(train, batch, rows, packed, logits, values, targets, False)
    torch.testing.assert_close(full, stats["pg_loss"] + 0.5 * v_loss)


def test_batch_metrics_report_staleness_lengths_and_groups_without_signal():
    batch = hand_batch()
    targets = StepTargets(old_logp=batch.rollout_logp, advantages=batch.mask.clone())
    metrics = objective.batch_metrics(batch, targets, policy_version=6)
    assert metrics["staleness_max"] == 3.0 and metrics["staleness_mean"] == 2.0
    assert metrics["generated_by_version_min"] == 3.0 and metrics["generated_by_version_max"] == 5.0
    assert metrics["zero_variance_groups"] == 0.5  # group 1 scored 1 and 1
    assert metrics["response_length_mean"] == 2.75 and metrics["response_length_max"] == 3.0
    assert metrics["termination_rate"] == 0.25 and metrics["truncation_rate"] == 0.75
    assert metrics["groups"] == 2.0 and metrics["completions"] == 4.0
    assert "explained_variance" not in metrics and not any(key.startswith("off_policy/") for key in metrics)


def test_a_token_the_correction_weights_zero_takes_no_part_in_the_policy_loss():
    batch = hand_batch()
    rows = torch.tensor([0, 2])
    packed, logits = packed_and_logits(batch, rows)
    advantages = torch.tensor([[1.0, -2, 0.5], [1, 1, 1], [-1, 3, 2], [1, 1, 0]])
    weights = torch.tensor([[1.0, 0.0, 2.0], [1, 1, 1], [0.0, 0.5, 1.0], [1, 1, 0]])
    weighted = StepTargets(old_logp=batch.rollout_logp, advantages=advantages, weights=weights)
    _, stats = objective.micro_batch_loss(TrainConfig(), batch, rows, packed, logits, None, weighted, False)
    logp = token_logprobs(logits, packed.targets)
    ratio = (logp - batch.rollout_logp[rows]).exp()
    # token-mean over every valid token, the masked ones counted in the denominator, as IcePop and prime-rl count.
    expected = (-advantages[rows] * ratio * weights[rows] * batch.mask[rows]).sum() / batch.mask[rows].sum()
    torch.testing.assert_close(stats["pg_loss"], expected)


def test_the_batch_carries_each_token_s_version_and_a_completion_is_as_stale_as_its_oldest_sampled_token():
    def completion(versions, loss_mask=None) -> Completion:
        return Completion(
            text="x",
            token_ids=np.arange(len(versions), dtype=np.int32),
            logprobs=np.zeros(len(versions), np.float32),
            finish_reason="length",
            token_versions=np.asarray(versions, np.int32) if versions is not None else None,
            loss_mask=np.asarray(loss_mask, np.int32) if loss_mask is not None else None,
        )

    completions = [
        completion([4, 4, 5]),  # the rollout loaded version 5 before its last token
        completion([1, 5, 6], loss_mask=[0, 1, 1]),  # an inserted observation's version does not count
        sampled(2, 0.0, text="y"),
    ]
    group = experience_group("g", [1.0, 0.0, 1.0], completions=completions, policy_version=6, prompt_id="p", answer="")
    batch = Batch.of([group])
    torch.testing.assert_close(batch.token_versions, torch.tensor([[4.0, 4, 5], [1, 5, 6], [6, 6, 0]]))
    torch.testing.assert_close(batch.oldest_versions, torch.tensor([4.0, 5.0, 6.0]))
    metrics = objective.batch_metrics(batch, StepTargets(old_logp=batch.rollout_logp, advantages=batch.mask), 8)
    assert metrics["staleness_max"] == 4.0 and metrics["staleness_mean"] == pytest.approx(3.0)
    assert metrics["generated_by_version_min"] == 4.0 and metrics["generated_by_version_max"] == 6.0


def test_batch_metrics_report_the_ratio_and_what_the_correction_masked_when_pi_old_was_recomputed():
    batch = hand_batch()
    old_logp = batch.rollout_logp + torch.tensor([[0.0, 2.0, 0.0], [0, 0, 0], [0, 0, -0.5], [0, 0, 0]]) * batch.mask
    log_rho = log_ratio(old_logp, batch.rollout_logp, batch.mask)
    weights = correction_weights(log_rho, batch.mask, OffPolicyConfig(correction="icepop"))  # masks e^2 = 7.4
    targets = StepTargets(old_logp=old_logp, advantages=batch.mask.clone(), log_ratio=log_rho, weights=weights)
    metrics = objective.batch_metrics(batch, targets, policy_version=6)
    assert metrics["off_policy/masked_token_fraction"] == pytest.approx(1 / 11)
    assert metrics["off_policy/masked_sequence_fraction"] == pytest.approx(1 / 4)
    assert metrics["off_policy/ratio_max"] == pytest.approx(math.exp(2.0))
    assert metrics["off_policy/ratio_min"] == pytest.approx(math.exp(-0.5))  # inside IcePop's [0.5, 5]: kept


def test_every_statistic_of_the_loss_and_the_batch_is_declared_in_the_metrics_contract():
    batch = hand_batch()
    rows = torch.tensor([1, 2])
    packed, logits = packed_and_logits(batch, rows)
    values = torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.1, 0.4]])
    # PPO with importance weights: the optional statistics (critic, weights) are all there.
    targets = StepTargets(
        old_logp=batch.rollout_logp,
        advantages=batch.mask.clone(),
        old_values=torch.zeros_like(batch.mask),
        returns=torch.ones_like(batch.mask),
        weights=torch.ones_like(batch.mask),
        log_ratio=torch.zeros_like(batch.mask),
    )
    train = TrainConfig(algorithm="ppo")
    _, stats = objective.micro_batch_loss(train, batch, rows, packed, logits, values, targets, False)
    metrics = objective.batch_metrics(batch, targets, policy_version=6)
    row = {**stats, **metrics}
    check_row(row)
    optional = (
        m.VALUE_LOSS,
        m.VALUE_CLIPFRAC,
        m.EXPLAINED_VARIANCE,
        m.VALUE_MEAN,
        m.OFF_POLICY_WEIGHT_MEAN,
        m.OFF_POLICY_RATIO_P50,
    )
    assert {metric.key for metric in optional} <= set(row)
