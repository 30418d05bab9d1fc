"""Alert rules reviewed against a run: the closest approach is computed as the evaluator judges, and a suggested
threshold is one the run's own rows would not have fired."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from services.cli.alert_review import relative_changes, review_rule, review_run
from services.cli.app import app
from services.common.config import AlertRule
from services.trainer.alerts import AlertEvaluator

pytestmark = pytest.mark.unit


def rule(condition: str, threshold: float, window: int = 3, metric: str = "kl_ref") -> AlertRule:
    return AlertRule(name="r", metric=metric, condition=condition, threshold=threshold, window_steps=window)


def fires(alert: AlertRule, values: list[float]) -> int:
    """How often the trainer's own evaluator fires ``alert`` over these step values (no cooldown)."""
    evaluator = AlertEvaluator([alert], cooldown_steps=0, now=0.0)
    return sum(
        len(evaluator.observe({"step": step, alert.metric: value}, now=step)) for step, value in enumerate(values)
    )


SERIES = [0.1, 0.3, 0.8, 0.9, 0.7, 0.2, 0.95, 1.1, 1.0, 0.4, 0.3, 0.2]


@pytest.mark.parametrize("condition", ["above", "below", "rises_by", "falls_by"])
def test_the_closest_approach_is_where_the_evaluator_starts_to_fire_and_the_suggestion_stays_quiet(condition):
    review = review_rule(rule(condition, 0.0), [(float(i), v) for i, v in enumerate(SERIES)], firings=[])
    assert review.closest is not None and review.suggested is not None
    # Just inside the closest approach the rule fires on this run; at the suggestion it does not.
    inside = review.closest - 1e-9 if condition in ("above", "rises_by", "falls_by") else review.closest + 1e-9
    assert fires(rule(condition, inside), SERIES) > 0
    assert fires(rule(condition, review.suggested), SERIES) == 0


def test_relative_changes_are_the_evaluators_formula_and_skip_a_zero_mean():
    assert relative_changes([1.0, 1.0, 2.0, 4.0], window=2) == [pytest.approx(2.0)]
    assert relative_changes([0.0, 0.0, 1.0, 1.0], window=2) == []


def test_an_absent_rule_reviews_the_gaps_and_a_nan_rule_counts_what_was_not_finite():
    absent = AlertRule(name="a", metric="loss", condition="absent", window_s=60)
    review = review_rule(absent, [(0.0, 1.0), (10.0, 1.0), (45.0, 1.0)], firings=[])
    assert review.closest == 35.0 and review.suggested == pytest.approx(84.0)
    nan = review_rule(rule("nan", 0.0, metric="loss"), [(0.0, 1.0), (1.0, math.nan), (2.0, math.inf)], firings=[])
    assert nan.closest == 2.0 and nan.observed == 1


def test_a_run_reviews_each_rule_with_its_firings_and_a_rule_never_fed_is_not_judged():
    rules = [rule("above", 0.5), rule("below", 0.1, metric="entropy").model_copy(update={"name": "quiet"})]
    rows = [{"step": i, "time": float(i), "kl_ref": v} for i, v in enumerate(SERIES)]
    events = [{"kind": "alert", "rule": "r", "step": 4}, {"kind": "checkpoint", "step": 4}]
    fired, quiet = review_run(rules, rows, events)
    assert fired.firings == [4] and fired.verdict.startswith("fired 1 time(s)")
    assert fired.percentiles[50] == pytest.approx(sorted(SERIES)[5] / 2 + sorted(SERIES)[6] / 2)
    assert quiet.closest is None and quiet.verdict.startswith("not judged")


def test_rlpipe_alerts_review_prints_every_rule_of_the_runs_config(tmp_path, config_only_model):
    from tests.support.runs import write_config

    model_dir, data_dir = config_only_model
    run_dir = tmp_path / "runs" / "test"
    run_dir.mkdir(parents=True)
    write_config(run_dir / "effective-config.yaml", model_dir, data_dir, tmp_path / "runs")
    rows = [{"step": i, "time": float(i), "kl_ref": v, "entropy": 1.0} for i, v in enumerate(SERIES)]
    (run_dir / "metrics.jsonl").write_text("".join(f"{__import__('json').dumps(row)}\n" for row in rows))
    result = CliRunner().invoke(app, ["alerts", "review", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "kl_too_high" in result.output and "entropy_collapse" in result.output
    missing = CliRunner().invoke(app, ["alerts", "review", str(tmp_path)])
    assert missing.exit_code == 2 and "not a run directory" in missing.output
