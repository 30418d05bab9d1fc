"""Every algorithm option through the real pipeline (NATS, vLLM, one process per service)."""

import math

import pytest

from services.common.observe import metrics as m
from tests.support.runs import config_file, run_pipeline

# Whole pipelines, minutes each: the slow tier (make test runs it after the rest).
pytestmark = pytest.mark.e2e

# GRPO's held-out accuracy is as high after 30 steps as after 60 (docs/testing.md), PPO's nearly so with 5 critic-only
# steps instead of 10: the second half of a longer run costs as much as the first and proves nothing more.
HELDOUT_STEPS = 30


@pytest.mark.parametrize(
    ("algorithm", "train"),
    [
        ("dr_grpo", {"loss_agg": "seq-mean-token-sum-norm", "kl": {"coef": 0.01, "in": "reward", "estimator": "k1"}}),
        (
            "rloo",
            {
                "clip": {"low": 0.2, "high": 0.28, "dual": 3.0},
                "old_logprobs": "recompute",
                "off_policy": {"correction": "icepop"},
            },
        ),
        (
            "reinforce_pp",
            {
                "epochs": 2,
                "mini_batches": 2,
                "gamma": 0.99,
                "max_staleness": 0,
                "kl": {"estimator": "k2", "coef": 0.01},
            },
        ),
        (
            "ppo",
            {"critic": {"kind": "head", "warmup_steps": 1}, "loss_agg": "seq-mean-token-mean", "grad_accum_steps": 2},
        ),
    ],
)
def test_algorithm_runs_end_to_end(tiny_model, tmp_path, algorithm, train):
    config = config_file(
        tmp_path,
        tiny_model,
        run_id=algorithm,
        train={"algorithm": algorithm, "total_steps": 3, "batch_size": 8, "learning_rate": 1e-5, **train},
        data={"eval_every_steps": 0, "eval_size": 50},
        # Small enough that every group travels by claim check through the object store.
        nats={"claim_check_bytes": 600} if algorithm == "dr_grpo" else {},
    )
    done, rows = run_pipeline(config)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [r for r in rows if r.is_step]
    assert [r.step for r in steps] == [1, 2, 3]
    for row in steps:
        assert all(math.isfinite(v) for _, v in row.numbers()), row.raw
    if algorithm == "dr_grpo":
        # The work queues' bodies are deleted once consumed (claim_lifecycle); EXPERIENCE's stay until a purge.
        claims = tmp_path / "runs" / algorithm / "claims"
        assert list((claims / "experience").glob("*.reference-*")), "no group went by claim check"
    if algorithm == "rloo":
        # vLLM's logprobs against the trainer's: the ratio and what IcePop's band masked, every step.
        assert all(m.OFF_POLICY_MASKED_TOKENS in r and m.OFF_POLICY_RATIO_P50 in r for r in steps)
    if algorithm == "reinforce_pp":
        assert sum(r[m.DROPPED_STALE] for r in steps) > 0  # max_staleness 0 drops groups made before the last update
        assert all(r[m.STALENESS_MAX] <= 0 for r in steps)
    if algorithm == "ppo":
        assert steps[0][m.CRITIC_ONLY] == 1.0 and steps[1][m.CRITIC_ONLY] == 0.0
        assert all(m.EXPLAINED_VARIANCE in r for r in steps)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_training_improves_heldout_accuracy(tiny_model, tmp_path, algorithm):
    config = config_file(
        tmp_path,
        tiny_model,
        run_id=f"learn-{algorithm}",
        sampling={"group_size": 8, "max_new_tokens": 6},
        train={
            "algorithm": algorithm,
            "total_steps": HELDOUT_STEPS,
            "batch_size": 64,
            "learning_rate": 1e-4,
            "warmup_steps": 10,
            "kl": {"coef": 0.001},
            "critic": {"warmup_steps": 5},
        },
        data={"eval_every_steps": 0, "eval_size": 500},
        checkpoint={"save_every_steps": 0},
        rollout={"prompts_per_batch": 64},
    )
    done, rows = run_pipeline(config, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    evals = [r for r in rows if r.is_eval]
    # Once before the first step and once after the last (docs/testing.md: every eval is all 500 held-out rows).
    assert [r.step for r in evals] == [0, HELDOUT_STEPS]
    before, after = evals[0][m.EVAL_ACCURACY], evals[-1][m.EVAL_ACCURACY]
    assert after >= before + 0.05, (before, after)
    if algorithm == "ppo":
        # The critic learns: over the last ten steps its values explain some of the returns' variance (small on this
        # model, 0.002 here, but a critic that learned nothing scatters around 0 and fails half the time).
        explained = [r[m.EXPLAINED_VARIANCE] for r in rows if m.EXPLAINED_VARIANCE in r]
        assert sum(explained[-10:]) / 10 > 0, explained
