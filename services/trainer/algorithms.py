"""Pure RL math: advantage estimators, policy loss, KL estimators, entropy, loss aggregation.

No I/O and no state. Per-token tensors are ``[batch, response_len]`` with a 0/1
``mask`` over valid response tokens; functions compute in their input's dtype.
Estimators are registered by name so the config can select them and users can add
their own with the ``register_*`` decorators.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def _registrar(registry: dict) -> Callable[[str], Callable]:
    def register(name: str) -> Callable:
        def add(fn: Callable) -> Callable:
            registry[name] = fn
            return fn

        return add

    return register


register_advantage = _registrar(ADVANTAGE_ESTIMATORS)
register_kl = _registrar(KL_ESTIMATORS)
register_aggregation = _registrar(AGGREGATIONS)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * mask) / max(sum(mask), 1)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


# --- advantages ---------------------------------------------------------------------------


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response group sum, count and unbiased std (std of a singleton group is 1)."""
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1
    total = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, scores)
    count = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, torch.ones_like(scores))
    mean = total / count
    squares = torch.zeros(groups, dtype=scores.dtype).index_add_(0, index, (scores - mean[index]) ** 2)
    std = torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), torch.ones_like(count))
    return total[index], count[index], std[index]


@register_advantage("grpo")
def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (s_i - mean_g) / (std_g + eps), std unbiased; a singleton group has mean 0, std 1."""
    total, count, std = _group_stats(scores, group_ids)
    mean = torch.where(count > 1, total / count, torch.zeros_like(total))
    return (scores - mean) / (std + eps)


def group_advantages(scores: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """One advantage per response from its group's scores, by the named estimator."""
    return ADVANTAGE_ESTIMATORS[estimator](scores, group_ids, eps=eps)


# --- losses ---------------------------------------------------------------------------------


@register_aggregation("token-mean")
def token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over every valid token of the batch."""
    return masked_mean(loss_mat, mask)


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    return AGGREGATIONS[mode](loss_mat, mask)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate.

    r = exp(clamp(logp - old_logp, -20, 20));
    L = agg(-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)).
    stats: ``clipfrac`` = share of tokens where the clipped term was taken,
    ``approx_kl`` = masked mean of (old_logp - logp).
    """
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    advantages = advantages if advantages.dim() == logp.dim() else advantages[:, None].expand_as(logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    stats = {
        "clipfrac": masked_mean((clipped > unclipped).to(logp.dtype), mask).detach(),
        "approx_kl": masked_mean(old_logp - logp, mask).detach(),
    }
    return aggregate(loss_mat, mask, agg), stats


@register_kl("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp (unbiased, high variance)."""
    return logp - ref_logp


@register_kl("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1, log-ratio clamped to ±20, result to ±10 (Schulman's estimator)."""
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate by the named estimator."""
    return KL_ESTIMATORS[estimator](logp, ref_logp)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum(softmax(z) * z), per position."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
