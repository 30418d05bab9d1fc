"""train.deterministic at config load (what it refuses, naming the field), and which metrics-row keys two runs of one
reproducible config must repeat exactly."""

import math

import pytest

from services.common.config import Change, ConfigError, field_classes
from services.common.observe.records import metrics_rows
from services.common.observe.reproducible import comparable, is_reading, row_differences
from services.reward.model import forward_spans
from tests.support.runs import run_config

pytestmark = pytest.mark.unit

DETERMINISTIC = {"deterministic": True, "synchronous": True}


def config(tmp_path, config_only_model, **sections):
    return run_config(tmp_path, config_only_model, **sections)


def test_a_deterministic_config_with_synchronous_feeding_and_one_of_every_role_loads(tmp_path, config_only_model):
    cfg = config(tmp_path, config_only_model, train=DETERMINISTIC)
    assert cfg.train.deterministic and cfg.train.synchronous
    assert not config(tmp_path, config_only_model).train.deterministic  # off unless asked for
    assert field_classes()["train.deterministic"] == Change.RESTART


def test_a_deterministic_config_with_asynchronous_feeding_is_refused_naming_the_fields(tmp_path, config_only_model):
    with pytest.raises(
        ConfigError, match=r"train.deterministic needs train.synchronous: true .*max_inflight_batches 2"
    ):
        config(tmp_path, config_only_model, train={"deterministic": True})


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        ({"rollout": {"replicas": 2}}, "rollout.replicas is 2"),
        ({"reward": {"replicas": 3}}, "reward.replicas is 3"),
        ({"reference": {"replicas": 2}}, "reference.replicas is 2"),
        ({"trainer": {"nproc": 2}}, "trainer.nproc is 2"),
        ({"rollout": {"replicas": 2}, "trainer": {"nproc": 2}}, "rollout.replicas is 2, trainer.nproc is 2"),
    ],
)
def test_a_deterministic_config_with_several_processes_of_a_role_is_refused_naming_them(
    tmp_path, config_only_model, sections, named
):
    with pytest.raises(ConfigError, match=named):
        config(tmp_path, config_only_model, train=DETERMINISTIC, **sections)
    assert config(tmp_path, config_only_model, **sections)  # the same settings without it are fine


def test_readings_of_the_clock_the_machine_and_the_pipelines_health_are_left_out_and_results_kept():
    readings = [
        "time",
        "time/wait_s",
        "step_time_s",
        "tokens_per_s",
        "eval_time_s",
        "checkpoint_time_s",
        "weights/offer_s",
        "agent/env_seconds_mean",
        "memory/host_rss_gb",
        "gpu/util_pct",
        "disk_free_saves",
        "share/rollout/busy",
        "services_down",
        "roles_stalled",
        "role_restarts",
    ]
    results = ["step", "loss", "kl_ref", "reward_mean", "grad_norm", "eval_accuracy", "dropped_stale", "groups_lost"]
    assert [key for key in readings if not is_reading(key)] == []
    assert [key for key in results if is_reading(key)] == []
    row = dict.fromkeys(readings + results, 1.0)
    assert sorted(comparable(row)) == sorted(results)


def test_two_runs_rows_differ_only_where_a_result_differs_or_a_row_is_missing():
    first = metrics_rows(
        [{"step": 1, "loss": 0.5, "time": 1.0, "step_time_s": 0.1}, {"step": 2, "loss": math.nan, "time": 2.0}]
    )
    again = metrics_rows(
        [{"step": 1, "loss": 0.5, "time": 9.0, "step_time_s": 0.7}, {"step": 2, "loss": math.nan, "time": 8.0}]
    )
    assert row_differences(first, again) == []  # readings aside, and a skipped step's NaN loss in both
    changed = metrics_rows(
        [{"step": 1, "loss": 0.5 + 2**-40, "time": 1.0}, {"step": 2, "loss": math.nan, "kl_ref": 0.0}]
    )
    assert row_differences(first, changed) == [
        "row 0 (step 1): loss 0.5 != 0.5000000000009095",
        "row 1 (step 2): kl_ref None != 0.0",
    ]
    assert row_differences(first, first[:1]) == ["2 rows against 1"]


def test_a_reward_models_passes_never_hold_two_groups_when_told_the_groups():
    assert forward_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert forward_spans(10, 4, [3, 5, 2]) == [(0, 3), (3, 7), (7, 8), (8, 10)]
    assert forward_spans(0, 4) == []
