import math

import pytest
import torch

from services.trainer.algorithms import entropy_from_logits, group_advantages, kl_penalty, masked_mean, policy_loss


def test_grpo_advantages_worked_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1])
    adv = group_advantages(scores, groups, "grpo", eps=0.0)
    # group 0: mean 0.5, unbiased std sqrt(1/3); the singleton has mean 0 and std 1.
    std = math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 5.0], dtype=torch.float64))


def test_equal_scores_give_zero_advantage():
    adv = group_advantages(torch.tensor([0.7, 0.7, 0.7]), torch.tensor([4, 4, 4]))
    assert torch.all(adv == 0)


def test_policy_loss_clips_only_beyond_the_range():
    mask = torch.ones(1, 3)
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5]]))  # ratios 1.0, 1.5, 0.5
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, 0.2, 0.2)
    # A > 0: min(r, clip(r)) -> 1.0, 1.2, 0.5 ; loss is their negated mean
    assert loss.item() == pytest.approx(-(1.0 + 1.2 + 0.5) / 3)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)
    assert stats["approx_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3)


def test_policy_loss_ignores_masked_tokens():
    mask = torch.tensor([[1.0, 0.0]])
    logp = torch.tensor([[0.0, 5.0]])
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), mask, 0.2, 0.2)
    assert loss.item() == pytest.approx(-2.0)


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, 0.0]))
    expected_k3 = math.exp(-0.5) + 0.5 - 1
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([expected_k3, 0.0]))
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([100.0]), "k3").item() == 10.0  # clamped


def test_entropy_of_uniform_and_peaked():
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    assert entropy_from_logits(torch.tensor([100.0, 0.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)


def test_masked_mean():
    assert masked_mean(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 0.0])).item() == 2.0
