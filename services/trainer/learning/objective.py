"""What one trainer step optimizes, as functions of the batch and the train config: no model, no optimizer, no
process group. ``Learner`` runs the forward passes and the updates and calls these on their outputs, so each can be
tested on hand-made tensors.

- ``advantages``: per-token advantages by the configured algorithm (GAE for PPO, REINFORCE++'s whitened returns,
  or a group estimator registered in ``services.common.registry``), with the KL penalty folded into the rewards when
  ``train.kl.placement`` is ``reward``.
- ``micro_batch_loss``: the loss of one micro-batch: the clipped surrogate (times the off-policy correction's weights),
  minus the entropy bonus, plus the KL term when placed in the loss, plus (PPO) the clipped value loss.
- ``batch_metrics``: what the step reports about the batch itself (rewards, advantages, lengths, staleness, the
  rollout/trainer ratio and what the correction masked).
"""

from __future__ import annotations

import torch

from services.common.config.training import TrainConfig
from services.common.model.modeling import ResponseBatch, token_logprobs
from services.trainer.learning.algorithms import (
    aggregate,
    entropy_from_logits,
    gae,
    group_advantages,
    kl_penalty,
    policy_loss,
    reinforce_pp_returns,
    value_loss,
    whiten,
)
from services.trainer.learning.batch import Batch, StepTargets
from services.trainer.learning.corrections import ratio_metrics

ALIASES = {"dr_grpo": "grpo_no_std"}  # algorithm name -> group advantage estimator


def advantages(
    train: TrainConfig, batch: Batch, old_logp: torch.Tensor, old_values: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages ``[N, R]`` and, for PPO, the value targets (``None`` otherwise).

    With the KL in the reward, each token's reward is ``r_t - coef * KL_t(pi_old || pi_ref)``."""
    mask = batch.mask
    token_rewards = batch.token_rewards()
    if train.kl.placement == "reward" and train.kl.coef > 0:
        token_rewards = token_rewards - train.kl.coef * kl_penalty(old_logp, batch.ref_logp, train.kl.estimator) * mask
    if train.algorithm == "ppo":
        if old_values is None:
            raise ValueError("PPO's advantages need the critic's values of the batch, and none were scored")
        advantage, returns = gae(token_rewards, old_values, mask, train.gamma, train.lam)
        return whiten(advantage, mask) * mask, returns
    if train.algorithm == "reinforce_pp":
        return whiten(reinforce_pp_returns(token_rewards, mask, train.gamma), mask) * mask, None
    scores = token_rewards.sum(-1)
    estimator = ALIASES.get(train.algorithm, train.algorithm)
    return group_advantages(scores, batch.group_index, estimator)[:, None] * mask, None


def micro_batch_loss(
    train: TrainConfig,
    batch: Batch,
    rows: torch.Tensor,
    packed: ResponseBatch,
    logits: torch.Tensor,
    values: torch.Tensor | None,
    targets: StepTargets,
    critic_only: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of the micro-batch ``rows`` of ``batch`` (``packed``, with the policy's ``logits`` and the critic's
    ``values`` over it) and its statistics.

    ``loss = pg_loss - entropy_coef * H [+ kl_coef * KL] [+ value_coef * v_loss]``; during the critic's warm-up
    (``critic_only``) only ``value_coef * v_loss``."""
    r = packed.mask.shape[1]
    at = rows.to(batch.mask.device)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[at, :r]

    # The model's own tokens only: an observation's tokens are context, neither acted on nor scored.
    mask = cut(batch.mask)
    logp = token_logprobs(logits, packed.targets)
    # One horizon for the whole batch, so seq-mean-token-sum-norm does not depend on a micro-batch's width.
    horizon = batch.mask.shape[1]
    pg_loss, stats = policy_loss(
        logp,
        cut(targets.old_logp),
        cut(targets.advantages),
        mask,
        train.clip.low,
        train.clip.high,
        train.clip.dual,
        train.loss_agg,
        weights=cut(targets.weights) if targets.weights is not None else None,
        horizon=horizon,
    )
    # Without an entropy bonus the entropy is a statistic only: no graph, so no backward pass over the vocab.
    with torch.set_grad_enabled(torch.is_grad_enabled() and train.entropy_coef > 0):
        entropy = aggregate(entropy_from_logits(logits), mask, train.loss_agg, horizon)
    kl = aggregate(kl_penalty(logp, cut(batch.ref_logp), train.kl.estimator), mask, train.loss_agg, horizon)
    loss = pg_loss - train.entropy_coef * entropy
    if train.kl.placement == "loss":
        loss = loss + train.kl.coef * kl
    stats |= {"pg_loss": pg_loss.detach(), "entropy": entropy.detach(), "kl_ref": kl.detach()}
    if values is not None:
        if targets.old_values is None or targets.returns is None:
            raise ValueError("the critic's value loss needs the step's old values and returns (PPO's targets)")
        v_loss, v_clipfrac = value_loss(
            values,
            cut(targets.old_values),
            cut(targets.returns),
            mask,
            train.critic.value_clip,
            train.loss_agg,
            horizon,
        )
        loss = train.critic.value_coef * v_loss if critic_only else loss + train.critic.value_coef * v_loss
        stats |= {"value_loss": v_loss.detach(), "value_clipfrac": v_clipfrac}
    stats["loss"] = loss.detach()
    return loss, stats


def batch_metrics(batch: Batch, targets: StepTargets, policy_version: int) -> dict[str, float]:
    """The step's metrics about its batch: rewards, advantages, response lengths, termination, the policy versions
    that generated it and their staleness against ``policy_version`` (a completion is as stale as its oldest sampled
    token), the ratio pi_old / pi_rollout and what the off-policy correction did (``ratio_metrics``), and (PPO) how
    well the values explain the returns (``1 - Var(returns - values) / Var(returns)``)."""
    advantage, returns, old_values = targets.advantages, targets.returns, targets.old_values
    mask = batch.mask
    lengths = batch.filled.sum(-1)
    group_std = torch.stack(
        [batch.rewards[batch.group_index == g].std(unbiased=False) for g in batch.group_index.unique()]
    )
    valid = mask.bool()
    staleness = policy_version - batch.oldest_versions  # [N]
    metrics = {
        "reward_mean": float(batch.rewards.mean()),
        "reward_std": float(batch.rewards.std()),
        "advantage_mean": float(advantage[valid].mean()),
        "advantage_std": float(advantage[valid].std()),
        "zero_variance_groups": float((group_std == 0).float().mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "termination_rate": float(batch.stopped.mean()),
        "truncation_rate": float(1 - batch.stopped.mean()),
        "generated_by_version_min": float(batch.oldest_versions.min()),
        "generated_by_version_max": float(batch.policy_versions.max()),
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        "mixed_version_fraction": float(batch.mixed_versions.float().mean()),
        "groups": float(batch.group_index.max() + 1),
        "completions": float(len(batch.pairs)),
    }
    if targets.log_ratio is not None:
        metrics |= ratio_metrics(targets.log_ratio, mask, targets.weights)
    if returns is not None and old_values is not None:
        residual_var = (returns - old_values)[valid].var()
        metrics["explained_variance"] = float(1 - residual_var / returns[valid].var().clamp(min=1e-8))
        metrics["value_mean"] = float(old_values[valid].mean())
    return metrics
