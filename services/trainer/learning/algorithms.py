"""Pure RL math: advantage estimators, policy and value losses, KL estimators, entropy, aggregation.

No I/O and no state. Per-token tensors are ``[batch, response_len]`` with a 0/1
``mask`` over valid response tokens; every function computes in its input's dtype.
Estimators and aggregations are registered by name, so the config selects them and
users can add their own with ``register_advantage`` / ``register_kl`` /
``register_aggregation``. The definitions follow verl's ``core_algos.py`` and
OpenRLHF, so a metric here means what it means there. The off-policy corrections toward the
rollout's logprobs (TIS, masked IS, IcePop, the geometric sequence mask) are in ``corrections.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from services.common.model import logit_math
from services.common.registry import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS

# The tables live in common, where config validates names against them without importing the trainer.
register_advantage = ADVANTAGE_ESTIMATORS.register
register_kl = KL_ESTIMATORS.register

AggregationUnit = Literal["token", "sequence"]
# What each aggregation averages over; micro-batching weights a micro-batch by its share of these units.
AGGREGATION_UNITS: dict[str, AggregationUnit] = {}


def register_aggregation(
    name: str, unit: AggregationUnit = "sequence"
) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorator: register a loss aggregation under ``name``.

    ``unit`` says what it is a mean over: ``"token"`` (every valid token of the batch) or
    ``"sequence"`` (every sequence with at least one valid token). The trainer needs it to
    split an optimizer step into micro-batches without changing the loss (``micro_batch_weight``).
    """

    def add(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        AGGREGATION_UNITS[name] = unit
        return AGGREGATIONS.register(name)(fn)

    return add


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * mask) / max(sum(mask), 1)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) * rsqrt(var + eps) over the masked entries, var unbiased (n - 1)."""
    mean = masked_mean(x, mask)
    centered = (x - mean) * mask
    var = (centered**2).sum() / (mask.sum() - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps)


# --- advantages -------------------------------------------------------------------------------


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over valid tokens only.

    delta_t = r_t + gamma * V_{t'} - V_t, with t' the next *valid* token (V = 0 past the end);
    A_t = delta_t + gamma * lam * A_{t'}; returns = A + V. Padding takes no part in the
    recursion and gets advantage 0. Advantages are not whitened here.
    """
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        valid = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage * valid
        # A padded position passes the carry through unchanged.
        next_value = torch.where(valid.bool(), values[:, t], next_value)
        next_advantage = torch.where(valid.bool(), advantage, next_advantage)
    return advantages, (advantages + values) * mask


def reinforce_pp_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted return-to-go G_t = r_t + gamma * G_{t'} over valid tokens (REINFORCE++).

    Whiten the result with ``whiten`` for the advantage.
    """
    running = torch.zeros_like(token_rewards[:, 0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t].bool()
        running = torch.where(valid, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running * mask[:, t]
    return returns


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, index = torch.unique(group_ids, return_inverse=True)
    return index, int(index.max()) + 1 if index.numel() else 0


def _group_sum(values: torch.Tensor, index: torch.Tensor, groups: int) -> torch.Tensor:
    return torch.zeros(groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


@register_advantage("grpo")
def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (s_i - mean_g) / (std_g + eps), std unbiased (as torch.std); a singleton group has mean 0, std 1."""
    index, groups = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, groups)
    mean = _group_sum(scores, index, groups) / count
    var = _group_sum((scores - mean[index]) ** 2, index, groups) / (count - 1).clamp(min=1)
    single = count[index] == 1
    mean_i = torch.where(single, torch.zeros_like(scores), mean[index])
    std_i = torch.where(single, torch.ones_like(scores), var.sqrt()[index])
    return (scores - mean_i) / (std_i + eps)


@register_advantage("grpo_no_std")
def grpo_no_std_advantages(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr.GRPO: A_i = s_i - mean_g (no division by the group std; a singleton group has mean 0)."""
    index, groups = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, groups)
    mean = _group_sum(scores, index, groups) / count
    return scores - torch.where(count[index] == 1, torch.zeros_like(scores), mean[index])


@register_advantage("rloo")
def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RLOO: A_i = s_i - mean of the other n - 1 scores of the group (a singleton group gets s_i)."""
    index, groups = _group_index(group_ids)
    count = _group_sum(torch.ones_like(scores), index, groups)
    mean = (_group_sum(scores, index, groups) / count)[index]
    count = count[index]
    # s - (sum - s) / (n - 1) == n / (n - 1) * (s - mean): this form is exactly 0 for equal scores.
    return torch.where(count > 1, count / (count - 1).clamp(min=1) * (scores - mean), scores)


def group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """One advantage per response from its group's scores, by the named estimator."""
    return ADVANTAGE_ESTIMATORS[estimator](scores, group_ids, eps=eps)


# --- aggregation ------------------------------------------------------------------------------


@register_aggregation("token-mean", unit="token")
def token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, horizon: int | None = None) -> torch.Tensor:
    """sum over all valid tokens / number of valid tokens."""
    return masked_mean(loss_mat, mask)


def _sequence_mean(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Sequences without valid tokens are left out of the mean.
    has_tokens = (mask.sum(-1) > 0).to(per_sequence.dtype)
    return (per_sequence * has_tokens).sum() / has_tokens.sum().clamp(min=1)


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat: torch.Tensor, mask: torch.Tensor, horizon: int | None = None) -> torch.Tensor:
    """mean over sequences of (sum over the sequence's valid tokens)."""
    return _sequence_mean((loss_mat * mask).sum(-1), mask)


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, horizon: int | None = None) -> torch.Tensor:
    """mean over sequences of (mean over the sequence's valid tokens)."""
    return _sequence_mean((loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1), mask)


@register_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_mat: torch.Tensor, mask: torch.Tensor, horizon: int | None = None) -> torch.Tensor:
    """Dr.GRPO: mean over sequences of (sum over valid tokens) / horizon, a constant (default: mask width)."""
    return _sequence_mean((loss_mat * mask).sum(-1) / (horizon or mask.shape[-1]), mask)


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", horizon: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar by the named mode."""
    return AGGREGATIONS[mode](loss_mat, mask, horizon=horizon)


def micro_batch_weight(micro_mask: torch.Tensor, step_mask: torch.Tensor, mode: str = "token-mean") -> float:
    """Weight w_m of a micro-batch's aggregate so that sum_m w_m * agg(L_m) = agg(L) over the whole step.

    An aggregation is a mean over units U (``AGGREGATION_UNITS``): agg(L) = sum_u l_u / |U|, so
    w_m = |U_m| / |U|. token-mean: U = valid tokens, w_m = sum(mask_m) / sum(mask) (the step's
    token mean, not a mean of micro-batch means); sequence means (seq-mean-token-sum,
    seq-mean-token-mean, seq-mean-token-sum-norm with one horizon for the step): U =
    sequences with a valid token. ``micro_mask`` ``[b, R_m]`` and ``step_mask`` ``[B, R]``;
    an empty step gives 0.
    """
    if AGGREGATION_UNITS.get(mode, "sequence") == "token":
        return float(micro_mask.sum()) / max(float(step_mask.sum()), 1.0)
    return float((micro_mask.sum(-1) > 0).sum()) / max(float((step_mask.sum(-1) > 0).sum()), 1.0)


# --- losses -----------------------------------------------------------------------------------


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clipping (clip-higher) and optional dual clip.

    r = exp(clamp(logp - old_logp, -20, 20));
    L_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high));
    with dual clip c > 1, for A < 0: L_t = min(L_t, -A c);
    L_t is multiplied by ``weights`` (an off-policy correction's, ``corrections.py``; 0 masks a token) when given;
    loss = agg(L). Advantages may be per response ``[B]`` or per token ``[B, T]``.
    stats: ``clipfrac`` share of valid tokens where the clipped term was taken,
    ``clipfrac_lower`` share where the dual clip was taken, ``approx_kl`` masked mean of
    (old_logp - logp).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    ratio = (logp - old_logp).clamp(-20.0, 20.0).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).to(logp.dtype)
    lower = torch.zeros_like(loss_mat)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        lower = ((advantages < 0) & (loss_mat > bound)).to(logp.dtype)
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, bound), loss_mat)
    if weights is not None:
        loss_mat = loss_mat * weights
    stats = {
        "clipfrac": masked_mean(clipfrac, mask).detach(),
        "clipfrac_lower": masked_mean(lower, mask).detach(),
        "approx_kl": masked_mean(old_logp - logp, mask).detach(),
    }
    return aggregate(loss_mat, mask, agg, horizon), stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    agg: str = "token-mean",
    horizon: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * agg(max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2)).

    ``horizon`` as in ``aggregate``. Returns the loss and the share of valid tokens where the clipped term was larger.
    """
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(unclipped_error, clipped_error), mask, agg, horizon)
    return loss, masked_mean((clipped_error > unclipped_error).to(values.dtype), mask).detach()


@register_kl("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp (unbiased, high variance)."""
    return logp - ref_logp


@register_kl("abs")
def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|logp - ref_logp|."""
    return (logp - ref_logp).abs()


@register_kl("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2."""
    return 0.5 * (logp - ref_logp) ** 2


@register_kl("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1, log-ratio clamped to ±20, result to ±10 (Schulman)."""
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate by the named estimator."""
    return KL_ESTIMATORS[estimator](logp, ref_logp)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum(softmax(z) * z), per position, in float32 at least, a few rows at a time
    (``logit_math.entropy``: no float32 copy of the whole ``[B, R, V]`` logits, in the forward or backward)."""
    return logit_math.entropy(logits)
