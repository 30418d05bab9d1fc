"""Off-policy corrections (``services/trainer/learning/corrections.py``): worked by hand, then against the peers'
published formulas, each written here loop by loop from its paper or documentation, on random tensors."""

import math

import pytest
import torch

from services.common import registry
from services.common.config.training import OffPolicyConfig, TrainConfig
from services.trainer.learning import corrections
from services.trainer.learning.algorithms import policy_loss
from services.trainer.learning.corrections import (
    correction_weights,
    geometric_sequence_mask,
    icepop_weights,
    log_ratio,
    masked_importance_weights,
    ratio_metrics,
    truncated_importance_weights,
)

pytestmark = pytest.mark.unit

F64 = torch.float64


def config(correction: str, **section) -> OffPolicyConfig:
    return OffPolicyConfig(correction=correction, **({correction: section} if section else {}))


def ratios(*rows: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """log rho and the mask of rows of ratios of different lengths (padding: None)."""
    width = max(len(row) for row in rows)
    rho = torch.tensor(
        [[r if r is not None else 1.0 for r in row] + [1.0] * (width - len(row)) for row in rows], dtype=F64
    )
    mask = torch.tensor([[float(r is not None) for r in row] + [0.0] * (width - len(row)) for row in rows], dtype=F64)
    return rho.log() * mask, mask


# --- by hand ----------------------------------------------------------------------------------


def test_tis_truncates_each_token_or_the_whole_sequence_product_at_the_cap():
    log_rho, mask = ratios([2.0, 9.0], [0.5, None])
    token = truncated_importance_weights(log_rho, mask, config("tis", level="token", cap=2.0))
    torch.testing.assert_close(token, torch.tensor([[2.0, 2.0], [0.5, 0.0]], dtype=F64))
    sequence = truncated_importance_weights(log_rho, mask, config("tis", level="sequence", cap=100.0))
    torch.testing.assert_close(sequence, torch.tensor([[18.0, 18.0], [0.5, 0.0]], dtype=F64))


def test_masked_is_keeps_the_ratio_inside_the_band_and_zeroes_the_token_or_sequence_outside_it():
    log_rho, mask = ratios([0.4, 1.5, 3.0], [1.2, 1.2, None])
    token = masked_importance_weights(log_rho, mask, config("masked_is", level="token", low=0.5, high=2.0))
    torch.testing.assert_close(token, torch.tensor([[0.0, 1.5, 0.0], [1.2, 1.2, 0.0]], dtype=F64))
    # Products: 0.4 * 1.5 * 3 = 1.8 (kept, every token weighted by it); 1.2 * 1.2 = 1.44 (kept).
    sequence = masked_importance_weights(log_rho, mask, config("masked_is", level="sequence", low=0.5, high=1.5))
    torch.testing.assert_close(sequence, torch.tensor([[0.0, 0.0, 0.0], [1.44, 1.44, 0.0]], dtype=F64))


def test_icepop_masks_tokens_outside_alpha_beta_and_weights_the_rest_by_their_ratio():
    log_rho, mask = ratios([0.49, 0.5, 1.0, 5.0, 5.01])
    weights = icepop_weights(log_rho, mask, config("icepop"))  # the paper's [0.5, 5]
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.5, 1.0, 5.0, 0.0]], dtype=F64))


def test_the_geometric_mask_drops_a_response_by_its_mean_per_token_ratio_not_its_length():
    # Ratio 1.01 on every token: the product grows with the length (1.01^200 = 7.3), the geometric mean stays 1.01.
    long = [1.01] * 200
    log_rho, mask = ratios(long, [1.01, 1.01], [1.3, 0.8, None])  # the last: geometric mean sqrt(1.04) = 1.0198
    kept = geometric_sequence_mask(log_rho, mask, config("seq_geo_mask", low=0.98, high=1.015))
    assert kept[0, :200].eq(1).all() and kept[1, :2].eq(1).all() and kept[2].eq(0).all()
    with_tis = geometric_sequence_mask(log_rho, mask, config("seq_geo_mask", low=0.98, high=1.05, cap=1.2))
    torch.testing.assert_close(with_tis[2, :2], torch.tensor([1.2, 0.8], dtype=F64))  # min(rho_t, cap) when kept


def test_padding_takes_weight_zero_and_no_part_in_a_sequence_s_ratio():
    log_rho, mask = ratios([2.0, None, None])
    log_rho = log_rho + (1 - mask) * 50.0  # garbage on padding must not leak into the sequence's product
    for correction in ("tis", "masked_is", "icepop", "seq_geo_mask"):
        section = {"level": "sequence"} if correction in ("tis", "masked_is") else {}
        weights = correction_weights(log_rho * mask, mask, config(correction, **section))
        assert weights[0, 1:].eq(0).all(), correction


def test_weights_carry_no_gradient_and_none_means_no_weights():
    old = torch.tensor([[-0.5, -1.0]], dtype=F64, requires_grad=True)
    rollout = torch.tensor([[-0.6, -0.7]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    log_rho = log_ratio(old, rollout, mask)
    assert not log_rho.requires_grad
    assert not correction_weights(log_rho, mask, config("icepop")).requires_grad
    assert correction_weights(log_rho, mask, OffPolicyConfig()) is None


def test_ratio_metrics_report_quantiles_mismatch_kl_and_what_was_masked():
    log_rho, mask = ratios([0.25, 1.0, 1.0, 1.0], [1.0, 8.0, None, None])
    weights = icepop_weights(log_rho, mask, config("icepop"))  # masks 0.25 and 8.0
    metrics = ratio_metrics(log_rho, mask, weights)
    valid = torch.tensor([0.25, 1.0, 1.0, 1.0, 1.0, 8.0], dtype=F64)
    assert metrics["off_policy/ratio_min"] == pytest.approx(0.25)
    assert metrics["off_policy/ratio_max"] == pytest.approx(8.0)
    expected = torch.quantile(valid, torch.tensor([0.05, 0.5, 0.95], dtype=F64))
    assert [metrics[f"off_policy/ratio_p{p}"] for p in (5, 50, 95)] == pytest.approx(expected.tolist())
    k3 = valid - valid.log() - 1
    assert metrics["off_policy/mismatch_kl"] == pytest.approx(float(k3.mean()))
    assert metrics["off_policy/masked_token_fraction"] == pytest.approx(2 / 6)
    assert metrics["off_policy/masked_sequence_fraction"] == pytest.approx(1.0)  # each response has a masked token
    assert metrics["off_policy/weight_mean"] == pytest.approx(4 / 6) and metrics["off_policy/weight_max"] == 1.0
    without = ratio_metrics(log_rho, mask, None)
    assert "off_policy/masked_token_fraction" not in without and without["off_policy/ratio_max"] == 8.0


def test_ratio_quantiles_match_torch_quantile_on_random_ratios():
    generator = torch.Generator().manual_seed(1)
    log_rho = torch.randn(37, 23, generator=generator, dtype=F64) * 0.3
    mask = (torch.rand(37, 23, generator=generator) > 0.3).to(F64)
    metrics = ratio_metrics(log_rho, mask, None)
    expected = torch.quantile(log_rho[mask.bool()].exp(), torch.tensor([0.05, 0.5, 0.95], dtype=F64))
    assert [metrics[f"off_policy/ratio_p{p}"] for p in (5, 50, 95)] == pytest.approx(expected.tolist(), abs=1e-6)


# --- against the peers' formulas --------------------------------------------------------------
# Each reference is written from the formula its source publishes, one sequence and one token at a time in ratio
# space, so it shares no code (and no log-space shortcut) with the vectorised functions it checks.


def random_case(seed: int, spread: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(16, 24, generator=generator, dtype=F64) * 3  # log pi_old
    rollout = old + torch.randn(16, 24, generator=generator, dtype=F64) * spread  # log pi_rollout
    lengths = torch.randint(1, 25, (16,), generator=generator)
    mask = (torch.arange(24)[None, :] < lengths[:, None]).to(F64)
    return old, rollout, mask


def reference_tis(old, rollout, mask, level, cap):
    """verl's rollout_is token / sequence (Yao et al. 2025): w_t = min(pi_old/pi_rollout, C);
    w_seq = min(prod_t pi_old/pi_rollout, C) on every token."""
    out = torch.zeros_like(old)
    for i in range(old.shape[0]):
        n = int(mask[i].sum())
        token = [math.exp(old[i, t] - rollout[i, t]) for t in range(n)]
        product = math.prod(token)
        for t in range(n):
            out[i, t] = min(token[t] if level == "token" else product, cap)
    return out


def reference_masked(old, rollout, mask, level, low, high):
    """Masked IS (Liu, Li et al. 2025; AReaL's cap; prime-rl's token mask): rho * 1[low <= rho <= high], for the
    token's rho or the sequence's product on every token; slime's and verl's icepop is the token case."""
    out = torch.zeros_like(old)
    for i in range(old.shape[0]):
        n = int(mask[i].sum())
        token = [math.exp(old[i, t] - rollout[i, t]) for t in range(n)]
        product = math.prod(token)
        for t in range(n):
            rho = token[t] if level == "token" else product
            out[i, t] = rho if low <= rho <= high else 0.0
    return out


def reference_geometric(old, rollout, mask, low, high, cap):
    """verl's geometric rejection (rho_geo = (prod_t rho_t)^(1/|T|), accepted when low <= rho_geo <= high), with
    its token TIS min(rho_t, C) on accepted sequences when C is given; prime-rl's geo mask is the same test."""
    out = torch.zeros_like(old)
    for i in range(old.shape[0]):
        n = int(mask[i].sum())
        token = [math.exp(old[i, t] - rollout[i, t]) for t in range(n)]
        geometric = math.prod(token) ** (1.0 / n)
        for t in range(n):
            if low <= geometric <= high:
                out[i, t] = min(token[t], cap) if cap is not None else 1.0
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("level", "cap"), [("token", 2.0), ("sequence", 5.0)])
def test_tis_matches_verl_s_formula(seed, level, cap):
    old, rollout, mask = random_case(seed, spread=0.1)
    got = correction_weights(log_ratio(old, rollout, mask), mask, config("tis", level=level, cap=cap))
    torch.testing.assert_close(got, reference_tis(old, rollout, mask, level, cap), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("level", "low", "high", "spread"), [("token", 0.8, 1.25, 0.3), ("sequence", 0.5, 2.0, 0.1)])
def test_masked_is_matches_the_published_formula(seed, level, low, high, spread):
    old, rollout, mask = random_case(seed, spread)
    cfg = config("masked_is", level=level, low=low, high=high)
    got = correction_weights(log_ratio(old, rollout, mask), mask, cfg)
    expected = reference_masked(old, rollout, mask, level, low, high)
    assert 0 < int((expected == 0).logical_and(mask.bool()).sum()) < int(mask.sum())  # the band cuts both ways
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_icepop_matches_the_paper_and_slime_s_formula(seed):
    old, rollout, mask = random_case(seed, spread=1.0)  # wide: some tokens leave [0.5, 5]
    got = correction_weights(log_ratio(old, rollout, mask), mask, config("icepop"))
    expected = reference_masked(old, rollout, mask, "token", 0.5, 5.0)
    assert int((expected == 0).logical_and(mask.bool()).sum()) > 0
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("low", "high", "cap"), [(0.97, 1.03, None), (0.95, 1.02, 2.0)])
def test_the_geometric_mask_matches_verl_s_geometric_rejection(seed, low, high, cap):
    old, rollout, mask = random_case(seed, spread=0.1)
    got = correction_weights(log_ratio(old, rollout, mask), mask, config("seq_geo_mask", low=low, high=high, cap=cap))
    expected = reference_geometric(old, rollout, mask, low, high, cap)
    kept = expected.sum(-1) > 0
    assert 0 < int(kept.sum()) < len(kept)  # some responses kept, some masked
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_masked_is_at_a_step_s_only_update_has_prime_rl_s_gradient(seed):
    """prime-rl's loss: rho = pi_theta / pi_inference, tokens outside [token_mask_low, token_mask_high] masked,
    loss = -sum over kept tokens of stopgrad(rho * A) * log pi_theta, over the tokens' count. At a step's only update
    pi_theta is pi_old, so the clipped surrogate (ratio 1) times masked_is's weights must have the same gradient."""
    old, rollout, mask = random_case(seed, spread=0.3)
    advantages = torch.randn(old.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    ours = old.clone().requires_grad_(True)
    weights = correction_weights(
        log_ratio(ours, rollout, mask), mask, config("masked_is", level="token", low=0.8, high=1.25)
    )
    loss, _ = policy_loss(ours, ours.detach(), advantages, mask, 0.2, 0.2, weights=weights)
    loss.backward()

    theirs = old.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for i in range(old.shape[0]):
        for t in range(int(mask[i].sum())):
            rho = math.exp(float(theirs[i, t].detach() - rollout[i, t]))
            if 0.8 <= rho <= 1.25:
                total = total - (rho * float(advantages[i, t])) * theirs[i, t]
    (total / mask.sum()).backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-9)


# --- config and registry ----------------------------------------------------------------------


def test_a_registered_correction_is_selectable_by_name():
    with pytest.raises(ValueError, match="'halve' is not one of"):
        OffPolicyConfig(correction="halve")

    @corrections.register_correction("halve")
    def halve(log_rho, mask, cfg):
        return 0.5 * mask

    try:
        log_rho, mask = ratios([1.5, 1.0])
        assert correction_weights(log_rho, mask, OffPolicyConfig(correction="halve")).eq(0.5).all()
    finally:
        del registry.OFF_POLICY_CORRECTIONS["halve"]


@pytest.mark.parametrize("correction", ["tis", "masked_is", "icepop", "seq_geo_mask"])
def test_a_correction_without_recomputed_logprobs_is_refused_naming_the_fields(correction):
    with pytest.raises(ValueError, match=r"off_policy\.correction .* old_logprobs: recompute"):
        TrainConfig(off_policy={"correction": correction})
    assert TrainConfig(old_logprobs="recompute", off_policy={"correction": correction}).off_policy.correction


@pytest.mark.parametrize(
    ("section", "band"),
    [("masked_is", {"low": 1.1}), ("icepop", {"high": 0.9}), ("seq_geo_mask", {"low": 1.01, "high": 1.02})],
)
def test_a_band_that_leaves_out_ratio_one_is_refused_naming_the_section(section, band):
    with pytest.raises(ValueError, match=rf"off_policy\.{section}\n.*must hold 1"):
        TrainConfig(old_logprobs="recompute", off_policy={"correction": section, section: band})


@pytest.mark.parametrize(
    ("legacy", "correction", "level", "cap"),
    [
        ({"mode": "sequence", "cap": 3.0}, "tis", "sequence", 3.0),
        ({"mode": "token"}, "tis", "token", 2.0),
        ({"mode": "off"}, "none", "token", 2.0),
        ({"mode": False, "cap": 4.0}, "none", "token", 2.0),  # YAML 1.1 reads `off` as false
    ],
)
def test_the_tis_section_of_earlier_configs_reads_as_the_tis_correction(legacy, correction, level, cap):
    train = TrainConfig(old_logprobs="recompute", tis=legacy)
    assert (train.off_policy.correction, train.off_policy.tis.level, train.off_policy.tis.cap) == (
        correction,
        level,
        cap,
    )


def test_an_earlier_tis_section_beside_another_correction_is_refused():
    with pytest.raises(ValueError, match=r"tis .* and off_policy\.correction .*icepop"):
        TrainConfig(old_logprobs="recompute", tis={"mode": "token"}, off_policy={"correction": "icepop"})
