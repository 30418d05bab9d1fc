"""Off-policy corrections: how a step's loss accounts for tokens sampled by a policy other than the one it trains.

The ratio. rho_t = pi_old(y_t) / pi_rollout(y_t): pi_old is the trainer's policy at the start of the step
(``train.old_logprobs: recompute``), pi_rollout the sampling engine's logprob of the token, which the completion
carries. rho drifts from 1 for two reasons: staleness (the rollout held an older version: with in-flight weight
updates, each token the version that sampled it, so rho_t compares pi_old with that token's own behaviour policy)
and inference mismatch (the same weights in another engine: its kernels, bfloat16, an MoE router that picks other
experts). This is verl's decoupled mode, the IcePop paper's pi_train(theta_old) / pi_infer(theta_old), and what slime
and AReaL weight by. prime-rl takes pi_theta / pi_rollout at each update instead, which equals rho at a step's only
update (``epochs: 1``, ``mini_batches: 1``: pi_theta is pi_old there).

A correction maps log rho ``[B, T]`` and the response mask to weights w ``[B, T]`` without gradient; each token's
policy loss is multiplied by its weight (``policy_loss``'s ``weights``), so w = 0 masks the token out of the loss and
w = rho re-weights it toward the rollout's distribution. Corrections are registered by name
(``register_correction``) and chosen by ``train.off_policy.correction``; each reads its own section of
``OffPolicyConfig``. ``ratio_metrics`` says how far rho strayed and what the correction masked.
"""

from __future__ import annotations

import math

import torch

from services.common.config.training import OffPolicyConfig
from services.common.registry import OFF_POLICY_CORRECTIONS

register_correction = OFF_POLICY_CORRECTIONS.register
# exp of a log ratio past this overflows float32 long before it means anything (verl's SAFETY_BOUND).
LOG_RATIO_BOUND = 20.0


def log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log rho_t = (old_logp_t - rollout_logp_t) * mask_t, without gradient; 0 off the mask."""
    return ((old_logp - rollout_logp) * mask).detach()  # [B, T]


def _ratio(log_rho: torch.Tensor) -> torch.Tensor:
    return log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


def _in_band(log_rho: torch.Tensor, low: float, high: float) -> torch.Tensor:
    # Compared in log space: a sequence's product of ratios may overflow where its log does not. log(0) = -inf.
    floor = math.log(low) if low > 0 else -math.inf
    return ((log_rho >= floor) & (log_rho <= math.log(high))).to(log_rho.dtype)


def sequence_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log prod_t rho_t = sum_t mask_t log rho_t, per sequence ``[B, 1]``."""
    return (log_rho * mask).sum(-1, keepdim=True)


def geometric_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log of the geometric mean ratio, sum_t mask_t log rho_t / max(sum_t mask_t, 1), per sequence ``[B, 1]``."""
    return sequence_log_ratio(log_rho, mask) / mask.sum(-1, keepdim=True).clamp(min=1)


@register_correction("tis")
def truncated_importance_weights(log_rho: torch.Tensor, mask: torch.Tensor, cfg: OffPolicyConfig) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025), ``cfg.tis``:

    token:    w_t = min(rho_t, cap)
    sequence: w_t = min(prod_s rho_s, cap) for every t of the sequence
    """
    level, cap = cfg.tis.level, cfg.tis.cap
    if level == "sequence":
        log_rho = sequence_log_ratio(log_rho, mask).expand_as(log_rho)  # [B, T]
    return _ratio(log_rho).clamp(max=cap) * mask


@register_correction("masked_is")
def masked_importance_weights(log_rho: torch.Tensor, mask: torch.Tensor, cfg: OffPolicyConfig) -> torch.Tensor:
    """Masked importance sampling (Liu, Li et al. 2025; prime-rl's token masks; AReaL's weight cap), ``cfg.masked_is``:

    token:    w_t = rho_t * 1[low <= rho_t <= high]
    sequence: w_t = rho_seq * 1[low <= rho_seq <= high] for every t of the sequence, rho_seq = prod_s rho_s
    Unlike truncation, a ratio outside the band takes the token (or the whole response) out of the loss.
    """
    band = cfg.masked_is
    if band.level == "sequence":
        log_rho = sequence_log_ratio(log_rho, mask).expand_as(log_rho)  # [B, T]
    return _ratio(log_rho) * _in_band(log_rho, band.low, band.high) * mask


@register_correction("icepop")
def icepop_weights(log_rho: torch.Tensor, mask: torch.Tensor, cfg: OffPolicyConfig) -> torch.Tensor:
    """IcePop (Ling Team 2025, Ring-1T, arXiv:2510.18855), ``cfg.icepop``: w_t = M(rho_t; alpha, beta) with
    M(k) = k for alpha <= k <= beta and 0 otherwise: tokens on which training and inference disagree beyond the band
    (an MoE router's flips compound over a long response) leave the gradient, the rest are importance weighted."""
    band = cfg.icepop
    return _ratio(log_rho) * _in_band(log_rho, band.low, band.high) * mask


@register_correction("seq_geo_mask")
def geometric_sequence_mask(log_rho: torch.Tensor, mask: torch.Tensor, cfg: OffPolicyConfig) -> torch.Tensor:
    """Geometric-mean sequence mask (verl's geometric rejection; prime-rl's geo mask), ``cfg.seq_geo_mask``:

    rho_geo = exp(sum_t mask_t log rho_t / sum_t mask_t)          per sequence (GSPO's length-normalised ratio)
    keep    = 1[low <= rho_geo <= high]                            the whole sequence
    w_t     = keep * min(rho_t, cap)   (cap null: w_t = keep)
    Unlike the product of ratios, the geometric mean does not grow with the response's length, so one band fits
    short and long responses alike; it is the mean per-token disagreement, so the band sits close to 1.
    """
    band = cfg.seq_geo_mask
    keep = _in_band(geometric_log_ratio(log_rho, mask), band.low, band.high)  # [B, 1]
    weights = _ratio(log_rho).clamp(max=band.cap) if band.cap is not None else torch.ones_like(log_rho)
    return keep * weights * mask


def correction_weights(log_rho: torch.Tensor, mask: torch.Tensor, cfg: OffPolicyConfig) -> torch.Tensor | None:
    """The weights ``[B, T]`` of the configured correction, or None with ``correction: none``."""
    if cfg.correction == "none":
        return None
    return OFF_POLICY_CORRECTIONS[cfg.correction](log_rho, mask, cfg).detach()


def _quantiles(values: torch.Tensor, qs: tuple[float, ...]) -> list[float]:
    """Linear-interpolated quantiles of a 1-D tensor, as ``torch.quantile`` takes them, by one sort: torch.quantile
    refuses inputs past 2**24 elements, fewer than the tokens of a large step."""
    ordered = values.sort().values  # [n]
    out = []
    for q in qs:
        position = q * (len(ordered) - 1)
        below = math.floor(position)
        above = min(below + 1, len(ordered) - 1)
        out.append(float(ordered[below] + (ordered[above] - ordered[below]) * (position - below)))
    return out


def ratio_metrics(log_rho: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None) -> dict[str, float]:
    """What the step reports about rho over its valid tokens, and what the correction did with it.

    ``off_policy/ratio_{min,p5,p50,p95,max}``: quantiles of rho_t; ``off_policy/mismatch_kl``: the mean of
    k3 = rho - log rho - 1, an estimate of KL(pi_rollout || pi_old) (0 when the trainer scores as the sampler did).
    With a correction: ``off_policy/weight_mean`` and ``_max`` (masked tokens count as 0),
    ``off_policy/masked_token_fraction`` (share of valid tokens with weight 0) and
    ``off_policy/masked_sequence_fraction`` (share of responses with at least one, as verl counts them).
    """
    valid = mask.bool()
    log_valid = log_rho[valid].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).float()  # [n]
    if not log_valid.numel():
        return {}
    ratio = log_valid.exp()
    quantiles = _quantiles(ratio, (0.05, 0.5, 0.95))
    metrics = {
        "off_policy/ratio_min": float(ratio.min()),
        "off_policy/ratio_p5": quantiles[0],
        "off_policy/ratio_p50": quantiles[1],
        "off_policy/ratio_p95": quantiles[2],
        "off_policy/ratio_max": float(ratio.max()),
        "off_policy/mismatch_kl": float((ratio - log_valid - 1).mean()),
    }
    if weights is not None:
        masked = (weights == 0) & valid  # [B, T]
        has_tokens = valid.any(-1)
        metrics |= {
            "off_policy/weight_mean": float(weights[valid].mean()),
            "off_policy/weight_max": float(weights[valid].max()),
            "off_policy/masked_token_fraction": float(masked.sum() / valid.sum()),
            "off_policy/masked_sequence_fraction": float(masked.any(-1).sum() / has_tokens.sum().clamp(min=1)),
        }
    return metrics
