"""A trial's ``usage.`` metrics: read from the ended run's usage.json into the objective and constraint series."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.observe.usage import USAGE_FILE, RunCost
from services.tuner.procs import GpuMemory
from services.tuner.spec import Objective, TrialLimits
from services.tuner.trial import TrialProcess

pytestmark = pytest.mark.unit


def ended_trial(tmp_path: Path, objective: str, tracked: set[str], cost: RunCost | None) -> TrialProcess:
    run_dir = tmp_path / "runs" / "s-t0"
    run_dir.mkdir(parents=True)
    if cost is not None:
        (run_dir / USAGE_FILE).write_text(json.dumps(cost.as_record()))
    trial = TrialProcess(
        tmp_path / "trial.yaml",
        run_dir,
        total_steps=4,
        objective=Objective(metric=objective, direction="minimize"),
        limits=TrialLimits(),
        deadline_s=60,
        deadline_reason="trial.max_wall_s",
        gpu=GpuMemory(),
        tracked=tracked,
    )
    trial.steps = 4
    return trial


PRICED = RunCost(
    device_hours={"trainer": {"cpu-core": 0.02, "gpu": 0.0}, "rollout": {"cpu-core": 0.01, "gpu": 0.0}},
    prices={"cpu-core": 2.0},
    steps=4,
    accuracy_gain=0.15,
)


def test_the_objective_and_each_usage_constraint_get_the_finished_runs_quantity(tmp_path):
    trial = ended_trial(tmp_path, "usage.cost_per_accuracy_point", {"usage.cost", "usage.cpu_core_hours"}, PRICED)
    trial.read_usage()
    # 0.03 core-hours at 2.0 = 0.06; 0.15 gained = 15 points.
    assert trial.values == [(4, pytest.approx(0.06 / 15))]
    assert trial.series == {"usage.cost": [pytest.approx(0.06)], "usage.cpu_core_hours": [pytest.approx(0.03)]}


def test_an_unpriced_quantity_and_a_missing_file_leave_the_trial_unmeasured(tmp_path):
    no_gain = RunCost(PRICED.device_hours, PRICED.prices, steps=4, accuracy_gain=0.0)
    trial = ended_trial(tmp_path / "a", "usage.cost_per_accuracy_point", {"usage.gpu_hours"}, no_gain)
    trial.read_usage()
    assert trial.values == [] and trial.series == {"usage.gpu_hours": [0.0]}

    never_ended = ended_trial(tmp_path / "b", "usage.cost", {"usage.cost"}, None)
    never_ended.read_usage()
    assert never_ended.values == [] and never_ended.series == {"usage.cost": []}


def test_metrics_file_keys_are_not_taken_from_usage(tmp_path):
    trial = ended_trial(tmp_path, "eval_accuracy", {"kl_ref"}, PRICED)
    trial.read_usage()
    assert trial.values == [] and trial.series == {"kl_ref": []}
