"""rlpipe verify's judgement of how the smoke run went, on crafted step rows (services/cli/verify/health.py)."""

from __future__ import annotations

import math

import pytest

from services.cli.verify.health import (
    JUMP_RULES,
    abnormal_jumps,
    first_step_check,
    jumps_check,
    ranges_check,
    remote_services,
    remote_services_check,
    resources_check,
)
from services.common.observe import metrics as m
from services.common.observe.records import MetricsRow
from services.common.observe.usage import ResourceTrend
from tests.support.runs import run_config

pytestmark = pytest.mark.unit


def row(step: int, **values: float) -> MetricsRow:
    base = {"step": step, "time": 1000.0 + 10 * step, "loss": 0.1, "entropy": 2.0, "reward_mean": 0.3, "kl_ref": 0.01}
    return MetricsRow(base | {key.replace("__", "/"): value for key, value in values.items()})


def test_ranges_pass_on_a_sane_run_and_name_a_loss_that_is_huge_or_not_a_number():
    rows = [row(1), row(2, loss=-0.4), row(3, loss=0.2)]
    passed = ranges_check(rows, max_abs_reward=1.0, with_critic=False)
    assert (passed.status, passed.detail) == ("pass", "loss -0.4..0.2 over 3 steps")
    failed = ranges_check([row(1), row(2, loss=5e4), row(3, loss=math.nan)], max_abs_reward=1.0, with_critic=False)
    assert failed.status == "fail"
    assert failed.detail == ("loss 50000.0 at step 2 (allowed |x| <= 1000); loss nan at step 3 (allowed |x| <= 1000)")


def test_with_a_critic_the_mean_value_must_stay_within_twice_the_largest_reward_and_be_logged():
    rows = [row(1, value_loss=0.5, value_mean=0.4), row(2, value_loss=0.3, value_mean=2.5)]
    failed = ranges_check(rows, max_abs_reward=1.0, with_critic=True)
    assert failed.status == "fail" and failed.detail == "value_mean 2.5 at step 2 (allowed |x| <= 2)"
    missing = ranges_check([row(1)], max_abs_reward=1.0, with_critic=True)
    assert missing.status == "fail" and "value_loss None at step 1" in missing.detail


def test_the_first_step_must_come_within_the_bound_of_the_start():
    rows = [row(1, step_time_s=0.25)]  # its row at 1010.0
    assert first_step_check(rows, started_at=900.0, max_s=120.0).status == "pass"
    late = first_step_check(rows, started_at=800.0, max_s=120.0)
    assert (late.status, late.detail) == ("fail", "first step 210.0 s after the start (bound 120 s), its update 0.25 s")
    assert first_step_check([], started_at=0.0, max_s=1.0).status == "skip"


def test_a_jump_beyond_the_floor_plus_a_multiple_of_the_smaller_value_is_abnormal():
    rule = JUMP_RULES[m.ENTROPY]  # floor 0.5, rel 1.0
    assert abnormal_jumps([(1, 2.0, 0.0), (2, 4.4, 0.0), (3, 2.1, 0.0)], rule) == []  # 2.4 <= 0.5 + 2.0
    assert abnormal_jumps([(1, 0.1, 0.0), (2, 0.55, 0.0)], rule) == []  # within the floor
    assert abnormal_jumps([(1, 2.0, 0.0), (2, 30.0, 0.0)], rule) == ["2 at step 1 -> 30 at step 2"]


def test_a_reward_mean_may_move_with_its_spread_but_not_flip_without_one():
    rule = JUMP_RULES[m.REWARD_MEAN]  # floor 0.5, rel 1.0, 3 reward_std
    assert abnormal_jumps([(1, 0.0, 0.4), (2, 1.0, 0.3)], rule) == []
    assert abnormal_jumps([(1, 0.0, 0.0), (2, 1.0, 0.0)], rule) == ["0 at step 1 -> 1 at step 2"]


def test_jumps_name_the_metric_and_steps_of_an_abnormal_change_and_skip_a_single_step():
    # The tiny model's own smoke run: KL 0 -> 2.9 -> 0.23 is a small batch's noise, not a blow-up.
    calm = jumps_check([row(1, kl_ref=0.0), row(2, entropy=1.8, kl_ref=2.92), row(3, reward_mean=0.9, kl_ref=0.23)])
    assert calm.status == "pass" and "kl_ref 2.92 -> 0.23" in calm.detail
    # Step 1 samples from the reference (KL 0 by construction): leaving it is not a jump, as the live run's 0 -> 6.3.
    assert jumps_check([row(1, kl_ref=0.0), row(2, kl_ref=6.3), row(3, kl_ref=3.1)]).status == "pass"
    wild = jumps_check([row(1), row(2, kl_ref=12.0), row(3, reward_mean=0.3), row(4, kl_ref=0.02)])
    assert wild.status == "fail"
    assert wild.detail == "kl_ref 12 at step 2 -> 0.01 at step 3"
    assert jumps_check([row(1)]).status == "skip"


def test_resources_flag_memory_that_grows_like_a_leak_after_the_first_step():
    steady = [row(1, memory__host_rss_gb=1.0), row(2, memory__host_rss_gb=2.0), row(3, memory__host_rss_gb=2.1)]
    passed = resources_check(steady)  # the first step's 1 GiB of optimizer state is not a leak
    assert (passed.status, passed.detail) == ("pass", "memory/host_rss_gb 2.00 -> 2.10 GiB")
    leaking = [row(1, memory__host_rss_gb=1.0), row(2, memory__host_rss_gb=2.0), row(3, memory__host_rss_gb=3.0)]
    failed = resources_check(leaking)
    assert (failed.status, failed.detail) == ("fail", "memory/host_rss_gb grew 1.00 GiB over 2 steps (2.00 -> 3.00)")


def test_resources_flag_a_process_of_any_role_whose_memory_grew_like_a_leak_after_the_first_step():
    rows = [row(1), row(2), row(3)]
    steady = [ResourceTrend("rollout", 11, 1.20, 1.25), ResourceTrend("reward", 12, 0.30, 0.31)]
    passed = resources_check(rows, steady)
    assert (passed.status, passed.detail) == (
        "pass",
        "reward host RSS 0.30 -> 0.31 GiB; rollout host RSS 1.20 -> 1.25 GiB",
    )
    # Two rollout replicas: one leaks 0.8 GiB (past 0.5 GiB and 25%); the role's line sums both.
    leaking = [*steady, ResourceTrend("rollout", 13, 1.20, 2.00)]
    failed = resources_check(rows, leaking)
    assert (failed.status, failed.detail) == (
        "fail",
        "rollout (pid 13) host RSS grew 0.80 GiB after the first step (1.20 -> 2.00)",
    )


def test_resources_flag_a_role_whose_gpu_memory_grew_like_a_leak_or_whose_gpu_never_ran_a_kernel():
    rows = [row(1), row(2), row(3)]
    # Two rollout replicas on GPUs and a reference on one; the reward holds none (no GPU line for it).
    steady = [
        ResourceTrend("rollout", 11, 1.2, 1.2, settled_gpu_gib=30.0, last_gpu_gib=30.5, gpu_util_peak_pct=91.0),
        ResourceTrend("rollout", 12, 1.2, 1.2, settled_gpu_gib=30.0, last_gpu_gib=30.0, gpu_util_peak_pct=0.0),
        ResourceTrend("reference", 13, 0.9, 0.9, settled_gpu_gib=2.0, last_gpu_gib=2.0, gpu_util_peak_pct=40.0),
        ResourceTrend("reward", 14, 0.3, 0.3),
    ]
    passed = resources_check(rows, steady)
    assert (passed.status, passed.detail) == (
        "pass",
        "reference host RSS 0.90 -> 0.90 GiB; reference GPU memory 2.00 -> 2.00 GiB; reference GPU utilisation up "
        "to 40%; reward host RSS 0.30 -> 0.30 GiB; rollout host RSS 2.40 -> 2.40 GiB; rollout GPU memory 60.00 -> "
        "60.50 GiB; rollout GPU utilisation up to 91%",
    )
    # The reference's GPU memory grows 1.5 GiB past its settled 2 GiB, and its GPU never ran a kernel.
    failing = [*steady[:2], ResourceTrend("reference", 13, 0.9, 0.9, 2.0, 3.5, 0.0), steady[3]]
    failed = resources_check(rows, failing)
    assert (failed.status, failed.detail) == (
        "fail",
        "reference (pid 13) GPU memory grew 1.50 GiB after the first step (2.00 -> 3.50); reference's GPUs never "
        "ran a kernel after the first step (utilisation 0 at every sample)",
    )


def test_resources_flag_a_gpu_out_of_headroom_or_never_busy_and_skip_rows_without_samples():
    rows = [
        row(s, memory__reserved_gb=10.0, memory__headroom_frac=h, gpu__util_pct=0.0) for s, h in ((1, 0.3), (2, 0.01))
    ]
    failed = resources_check(rows)
    assert failed.status == "fail"
    assert failed.detail == (
        "device memory headroom fell to 1.0% (below 2%); the GPU never ran a kernel during a step "
        "(gpu/util_pct 0 throughout)"
    )
    assert resources_check([row(1), row(2)]).status == "skip"


def test_remote_services_come_from_the_config_and_each_unreachable_one_is_named(tmp_path, config_only_model):
    cfg = run_config(
        tmp_path,
        config_only_model,
        reward={"functions": {"exact_match": 1.0}, "http": {"url": "http://rewards:8080/score"}},
        rollout={"environment_url": "http://env:9000"},
    )
    assert remote_services(cfg) == {
        "reward.http.url": "http://rewards:8080/score",
        "rollout.environment_url": "http://env:9000",
    }
    check = remote_services_check(
        {
            "reward.http.url": ("http://rewards:8080/score", None),
            "rollout.environment_url": ("http://env:9000", "refused"),
        }
    )
    assert (check.status, check.detail) == ("fail", "rollout.environment_url (http://env:9000): refused")
    assert remote_services_check({}).status == "skip"
