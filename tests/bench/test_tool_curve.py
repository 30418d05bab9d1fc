"""bench/tool_curve.py reads a run's held-out evaluations out of its metrics rows, and refuses a run without any."""

import json

import pytest

from bench.tool_curve import Evaluation, evaluations

pytestmark = pytest.mark.unit


def write_rows(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_evaluations_come_in_order_with_minutes_since_the_first_row(tmp_path):
    write_rows(
        tmp_path / "run",
        [
            {"time": 100.0, "step": 0, "eval_accuracy": 0.25, "eval/tool_calls_mean": 1.0},
            {"time": 130.0, "step": 1, "loss": 0.5},
            {"time": 220.0, "step": 10, "eval_accuracy": 0.5, "eval/tool_calls_mean": 0.75},
        ],
    )

    assert evaluations(tmp_path / "run") == [Evaluation(0, 0.0, 0.25, 1.0), Evaluation(10, 2.0, 0.5, 0.75)]


def test_a_run_that_never_evaluated_is_refused_naming_the_setting(tmp_path):
    write_rows(tmp_path / "run", [{"time": 100.0, "step": 1, "loss": 0.5}])

    with pytest.raises(ValueError, match=r"data\.eval_every_steps"):
        evaluations(tmp_path / "run")
