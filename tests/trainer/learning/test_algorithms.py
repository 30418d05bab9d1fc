"""Hand-worked cases for every function, then agreement with a loop-by-loop reference in float64."""

import math
import random

import pytest
import torch

from services.trainer.learning.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_UNITS,
    AGGREGATIONS,
    aggregate,
    entropy_from_logits,
    gae,
    group_advantages,
    kl_penalty,
    masked_mean,
    micro_batch_weight,
    policy_loss,
    register_advantage,
    register_aggregation,
    reinforce_pp_returns,
    value_loss,
    whiten,
)

pytestmark = pytest.mark.unit

F64 = torch.float64

# --- hand-worked ------------------------------------------------------------------------------


def test_gae_three_tokens_on_paper():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma = 0.9, lam = 0.8
    # d2 = 1 - 0.7 = 0.3;        A2 = 0.3
    # d1 = 0 + 0.9*0.7 - 0.6 = 0.03; A1 = 0.03 + 0.72*0.3 = 0.246
    # d0 = 0 + 0.9*0.6 - 0.5 = 0.04; A0 = 0.04 + 0.72*0.246 = 0.21712
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=F64)
    adv, ret = gae(rewards, values, torch.ones(1, 3, dtype=F64), 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]], dtype=F64))
    torch.testing.assert_close(ret, adv + values)


def test_gae_padding_does_not_leak():
    rewards = torch.tensor([[0.0, 1.0, 5.0, 5.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=F64)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    short, _ = gae(rewards[:, :2], values[:, :2], mask[:, :2], 1.0, 1.0)
    torch.testing.assert_close(adv[:, :2], short)
    assert adv[0, 2:].abs().sum() == 0 and ret[0, 2:].abs().sum() == 0


def test_whiten_is_zero_mean_unit_unbiased_variance_over_the_mask():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
    out = whiten(x, mask, eps=0.0)
    torch.testing.assert_close(out[0, :3], torch.tensor([-1.0, 0.0, 1.0], dtype=F64))  # var([1,2,3]) = 1


def test_grpo_advantages_worked_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0], dtype=F64)
    groups = torch.tensor([0, 0, 0, 0, 1])
    adv = group_advantages(scores, groups, "grpo", eps=0.0)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    torch.testing.assert_close(adv, torch.tensor([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 5.0], dtype=F64))


@pytest.mark.parametrize("estimator", ["grpo", "grpo_no_std", "rloo"])
def test_equal_scores_give_zero_advantage(estimator):
    adv = group_advantages(torch.tensor([0.7, 0.7, 0.7]), torch.tensor([4, 4, 4]), estimator)
    assert torch.all(adv == 0)


def test_dr_grpo_and_rloo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    groups = torch.tensor([7, 7, 7, 7])
    torch.testing.assert_close(
        group_advantages(scores, groups, "grpo_no_std"), torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=F64)
    )
    # RLOO: 1 - mean(0, 0, 1) = 2/3 ; 0 - mean(1, 0, 1) = -2/3
    torch.testing.assert_close(
        group_advantages(scores, groups, "rloo"), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3], dtype=F64)
    )


def test_reinforce_pp_returns_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
    torch.testing.assert_close(
        reinforce_pp_returns(rewards, mask, 0.5), torch.tensor([[0.25, 0.5, 1.0, 0.0]], dtype=F64)
    )


def test_policy_loss_clips_only_beyond_the_range():
    mask = torch.ones(1, 3)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5]]))  # ratios 1.0, 1.5, 0.5
    loss, stats = policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, 0.2, 0.2)
    # A > 0: min(r, clip(r)) -> 1.0, 1.2, 0.5 ; the loss is their negated mean
    assert loss.item() == pytest.approx(-(1.0 + 1.2 + 0.5) / 3)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)
    assert stats["approx_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3)


def test_clip_higher_is_asymmetric():
    logp = torch.log(torch.tensor([[1.25]]))
    loss_sym, _ = policy_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.2)
    loss_high, stats = policy_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28)
    assert loss_sym.item() == pytest.approx(-1.2) and loss_high.item() == pytest.approx(-1.25)
    assert stats["clipfrac"].item() == 0.0


def test_dual_clip_triggers_only_for_negative_advantages():
    logp = torch.log(torch.tensor([[10.0], [10.0]]))  # ratio 10 for both
    adv = torch.tensor([-1.0, 1.0])
    loss, stats = policy_loss(
        logp, torch.zeros(2, 1), adv, torch.ones(2, 1), 0.2, 0.2, dual_clip=3.0, agg="seq-mean-token-sum"
    )
    # A = -1: max(10, 1.2) = 10, bounded by c * |A| = 3 ; A = +1: max(-10, -1.2) = -1.2
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert stats["clipfrac_lower"].item() == pytest.approx(0.5)


def test_policy_loss_ignores_masked_tokens_and_applies_weights():
    mask = torch.tensor([[1.0, 0.0]])
    logp = torch.tensor([[0.0, 5.0]])
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), mask, 0.2, 0.2)
    assert loss.item() == pytest.approx(-2.0)
    weighted, _ = policy_loss(
        logp, torch.zeros(1, 2), torch.tensor([2.0]), mask, 0.2, 0.2, weights=torch.tensor([[0.5, 9.0]])
    )
    assert weighted.item() == pytest.approx(-1.0)


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)  # empty row left out
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", horizon=10).item() == pytest.approx((0.6 + 0.4) / 2)


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(kl_penalty(ref, logp, "abs"), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.125, 0.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([math.exp(-0.5) + 0.5 - 1, 0.0]))
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([100.0]), "k3").item() == 10.0  # clamped


def test_value_loss_clips_toward_the_old_value():
    values, old, returns = torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[3.0]])
    loss, clipfrac = value_loss(values, old, returns, torch.ones(1, 1), clip=0.5)
    # unclipped (2-3)^2 = 1 ; clipped v = 1.5 -> (1.5-3)^2 = 2.25 ; 0.5 * max = 1.125
    assert loss.item() == pytest.approx(1.125) and clipfrac.item() == 1.0


def test_entropy_of_uniform_and_peaked():
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    assert entropy_from_logits(torch.tensor([100.0, 0.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)


def test_masked_mean_and_user_registration():
    assert masked_mean(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 0.0])).item() == 2.0

    @register_advantage("constant_test")
    def constant(scores, group_ids, eps=1e-6):
        return torch.ones_like(scores)

    try:
        assert group_advantages(torch.tensor([3.0]), torch.tensor([0]), "constant_test").item() == 1.0
    finally:
        del ADVANTAGE_ESTIMATORS["constant_test"]


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def split_like_the_learner(x, rows_of, width_of):
    """Rows of ``x`` for one micro-batch, cut to that micro-batch's own padded width."""
    return x[rows_of][:, :width_of]


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_weights_reassemble_the_whole_step_aggregate(mode):
    # Rows of 3, 1, 0 (empty), 5, 2 and 4 valid tokens, split into micro-batches padded to their own longest row.
    lengths = [3, 1, 0, 5, 2, 4]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(5)] for n in lengths], dtype=F64)
    loss = torch.randn(6, 5, dtype=F64, generator=torch.Generator().manual_seed(0))
    values, old_values, returns = (
        torch.randn(6, 5, dtype=F64, generator=torch.Generator().manual_seed(k)) for k in (1, 2, 3)
    )
    whole = aggregate(loss, mask, mode, horizon=5)
    whole_value, _ = value_loss(values, old_values, returns, mask, 0.2, mode, horizon=5)
    split, split_value = torch.zeros((), dtype=F64), torch.zeros((), dtype=F64)
    for rows in ([3, 0], [1, 2, 5], [4]):
        width = max(lengths[i] for i in rows)
        m = split_like_the_learner(mask, rows, width)
        weight = micro_batch_weight(m, mask, mode)
        split += weight * aggregate(split_like_the_learner(loss, rows, width), m, mode, horizon=5)
        v_loss, _ = value_loss(
            *(split_like_the_learner(t, rows, width) for t in (values, old_values, returns)), m, 0.2, mode, horizon=5
        )
        split_value += weight * v_loss
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_value, whole_value, rtol=1e-12, atol=1e-12)


def test_micro_batch_weight_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    micro = mask[[0, 2]]  # 3 of the step's 6 tokens; 1 of its 3 sequences with tokens (the empty one counts for none)
    assert micro_batch_weight(micro, mask, "token-mean") == 3 / 6
    assert micro_batch_weight(micro, mask, "seq-mean-token-mean") == 1 / 3
    assert micro_batch_weight(micro[:, :0], torch.zeros(2, 0), "token-mean") == 0.0  # an empty step


def test_value_loss_sum_norm_uses_the_given_horizon_not_the_width():
    values, returns = torch.tensor([[2.0, 2.0]]), torch.tensor([[0.0, 0.0]])
    mask = torch.ones(1, 2)
    # 0.5 * (4 + 4) / horizon
    assert value_loss(values, values, returns, mask, 0.2, "seq-mean-token-sum-norm")[0].item() == 0.5 * 8 / 2
    assert value_loss(values, values, returns, mask, 0.2, "seq-mean-token-sum-norm", horizon=8)[0].item() == 0.5


def test_a_registered_aggregation_declares_what_it_averages_over():
    @register_aggregation("token-mean-twice_test", unit="token")
    def twice(loss_mat, mask, horizon=None):
        return 2 * masked_mean(loss_mat, mask)

    @register_aggregation("seq-max_test")
    def seq_max(loss_mat, mask, horizon=None):
        return (loss_mat * mask).amax(-1).mean()

    try:
        assert aggregate(torch.ones(1, 2), torch.ones(1, 2), "token-mean-twice_test").item() == 2.0
        assert AGGREGATION_UNITS["token-mean-twice_test"] == "token"
        assert AGGREGATION_UNITS["seq-max_test"] == "sequence"  # the default
        assert {name: AGGREGATION_UNITS[name] for name in MODES} == {
            "token-mean": "token",
            "seq-mean-token-sum": "sequence",
            "seq-mean-token-mean": "sequence",
            "seq-mean-token-sum-norm": "sequence",
        }
    finally:
        for name in ("token-mean-twice_test", "seq-max_test"):
            del AGGREGATIONS[name], AGGREGATION_UNITS[name]


# --- against an independent loop-by-loop reference, float64, random inputs --------------------


def ref_gae(r, v, m, gamma, lam):
    adv, ret = [], []
    for row_r, row_v, row_m in zip(r, v, m, strict=False):
        valid = [t for t, x in enumerate(row_m) if x > 0]
        a = [0.0] * len(row_r)
        last, next_v = 0.0, 0.0
        for t in reversed(valid):
            delta = row_r[t] + gamma * next_v - row_v[t]
            last = delta + gamma * lam * last
            a[t], next_v = last, row_v[t]
        adv.append(a)
        ret.append([a[t] + row_v[t] if row_m[t] > 0 else 0.0 for t in range(len(row_r))])
    return adv, ret


def ref_group(scores, groups, estimator, eps):
    out = []
    for i, s in enumerate(scores):
        mates = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        n = len(mates)
        mean = sum(mates) / n
        if estimator == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in mates) / (n - 1)) if n > 1 else 1.0
            out.append((s - (mean if n > 1 else 0.0)) / (std + eps))
        elif estimator == "grpo_no_std":
            out.append(s - (mean if n > 1 else 0.0))
        else:
            out.append(s - ((sum(mates) - s) / (n - 1) if n > 1 else 0.0))
    return out


def ref_policy_loss(logp, old, adv, m, lo, hi, dual, agg):
    rows = []
    for lp_row, old_row, a, m_row in zip(logp, old, adv, m, strict=False):
        row = []
        for lp, o, _masked in zip(lp_row, old_row, m_row, strict=False):
            r = math.exp(max(min(lp - o, 20), -20))
            term = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
            if dual is not None and a < 0:
                term = min(term, -a * dual)
            row.append(term)
        rows.append(row)
    return ref_aggregate(rows, m, agg)


def ref_aggregate(rows, m, agg):
    if agg == "token-mean":
        total = sum(x * mk for row, m_row in zip(rows, m, strict=False) for x, mk in zip(row, m_row, strict=False))
        return total / max(sum(sum(m_row) for m_row in m), 1)
    per_seq = []
    for row, m_row in zip(rows, m, strict=False):
        n = sum(m_row)
        if n == 0:
            continue
        s = sum(x * mk for x, mk in zip(row, m_row, strict=False))
        per_seq.append(
            {"seq-mean-token-sum": s, "seq-mean-token-mean": s / n, "seq-mean-token-sum-norm": s / len(row)}[agg]
        )
    return sum(per_seq) / max(len(per_seq), 1)


def random_batch(seed, batch=6, width=7):
    rng = random.Random(seed)
    mask = [[1.0 if t < rng.randint(0, width) or t == 0 else 0.0 for t in range(width)] for _ in range(batch)]
    mask[-1] = [0.0] * width  # one empty sequence
    draw = lambda: [[rng.gauss(0, 1) for _ in range(width)] for _ in range(batch)]  # noqa: E731
    return rng, mask, draw


@pytest.mark.parametrize("seed", range(5))
def test_gae_and_returns_match_reference(seed):
    rng, mask, draw = random_batch(seed)
    r, v = draw(), draw()
    gamma, lam = rng.uniform(0.8, 1.0), rng.uniform(0.8, 1.0)
    adv, ret = gae(torch.tensor(r, dtype=F64), torch.tensor(v, dtype=F64), torch.tensor(mask, dtype=F64), gamma, lam)
    ref_adv, ref_ret = ref_gae(r, v, mask, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=F64), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=F64), atol=1e-6, rtol=0)
    rtg = reinforce_pp_returns(torch.tensor(r, dtype=F64), torch.tensor(mask, dtype=F64), gamma)
    ref_rtg, _ = ref_gae(
        r, [[0.0] * len(row) for row in r], mask, gamma, 1.0
    )  # GAE with V=0, lam=1 is the return-to-go
    torch.testing.assert_close(rtg, torch.tensor(ref_rtg, dtype=F64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("seed", range(3))
def test_group_estimators_match_reference(estimator, seed):
    rng = random.Random(seed)
    groups = [rng.randint(0, 4) for _ in range(20)]
    scores = [rng.choice([0.0, 1.0, rng.gauss(0, 2)]) for _ in groups]
    got = group_advantages(torch.tensor(scores, dtype=F64), torch.tensor(groups), estimator, eps=1e-6)
    torch.testing.assert_close(
        got, torch.tensor(ref_group(scores, groups, estimator, 1e-6), dtype=F64), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("seed", range(3))
def test_policy_loss_matches_reference(agg, dual, seed):
    rng, mask, draw = random_batch(seed)
    logp, old = draw(), draw()
    adv = [rng.gauss(0, 1) for _ in mask]
    got, _ = policy_loss(
        torch.tensor(logp, dtype=F64),
        torch.tensor(old, dtype=F64),
        torch.tensor(adv, dtype=F64),
        torch.tensor(mask, dtype=F64),
        0.2,
        0.28,
        dual_clip=dual,
        agg=agg,
    )
    assert got.item() == pytest.approx(ref_policy_loss(logp, old, adv, mask, 0.2, 0.28, dual, agg), abs=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_kl_value_entropy_whiten_match_reference(seed):
    rng, mask, draw = random_batch(seed)
    logp, ref = draw(), draw()
    lp, rf = torch.tensor(logp, dtype=F64), torch.tensor(ref, dtype=F64)
    for name, fn in {
        "k1": lambda a, b: a - b,
        "abs": lambda a, b: abs(a - b),
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: max(min(math.exp(max(min(b - a, 20), -20)) - max(min(b - a, 20), -20) - 1, 10), -10),
    }.items():
        expected = torch.tensor(
            [[fn(a, b) for a, b in zip(ra, rb, strict=False)] for ra, rb in zip(logp, ref, strict=False)], dtype=F64
        )
        torch.testing.assert_close(kl_penalty(lp, rf, name), expected, atol=1e-6, rtol=0)

    values, old, returns = draw(), draw(), draw()
    got, _ = value_loss(
        torch.tensor(values, dtype=F64),
        torch.tensor(old, dtype=F64),
        torch.tensor(returns, dtype=F64),
        torch.tensor(mask, dtype=F64),
        0.2,
    )
    rows = [
        [max((v - g) ** 2, (o + max(min(v - o, 0.2), -0.2) - g) ** 2) for v, o, g in zip(rv, ro, rg, strict=False)]
        for rv, ro, rg in zip(values, old, returns, strict=False)
    ]
    assert got.item() == pytest.approx(0.5 * ref_aggregate(rows, mask, "token-mean"), abs=1e-6)

    logits = [rng.gauss(0, 3) for _ in range(11)]
    probs = [math.exp(z) / sum(math.exp(y) for y in logits) for z in logits]
    assert entropy_from_logits(torch.tensor(logits, dtype=F64)).item() == pytest.approx(
        -sum(p * math.log(p) for p in probs), abs=1e-6
    )

    flat = [x for row, m_row in zip(logp, mask, strict=False) for x, mk in zip(row, m_row, strict=False) if mk]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    expected = torch.tensor([[(x - mean) / std for x in row] for row in logp], dtype=F64)
    got = whiten(lp, torch.tensor(mask, dtype=F64), eps=0.0)
    m = torch.tensor(mask, dtype=torch.bool)
    torch.testing.assert_close(got[m], expected[m], atol=1e-6, rtol=0)


def test_gae_and_reinforce_pp_step_over_an_observation_span_as_if_it_were_not_there():
    """The convention docs/agents.md states: the last model token before an observation bootstraps from the
    first model token after it, discounted once, not once per observation token."""
    rewards = torch.tensor([[0.0, 0.0, 7.0, 7.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 9.0, 9.0, 0.7, 0.8]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]], dtype=F64)
    model = mask[0].bool()
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    alone_adv, alone_ret = gae(rewards[:, model], values[:, model], torch.ones(1, 4, dtype=F64), 0.9, 0.8)
    assert torch.equal(adv[:, model], alone_adv) and torch.equal(ret[:, model], alone_ret)
    assert adv[0, ~model].abs().sum() == 0 and ret[0, ~model].abs().sum() == 0
    returns = reinforce_pp_returns(rewards, mask, 0.9)
    assert torch.equal(returns[:, model], reinforce_pp_returns(rewards[:, model], torch.ones(1, 4, dtype=F64), 0.9))
