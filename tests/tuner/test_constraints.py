"""A trial's outcome as Optuna constraint values: <= 0 where a rule holds, > 0 by how far it was broken."""

from __future__ import annotations

import pytest

from services.tuner.constraints import constraint_names, constraint_values, feasible
from services.tuner.spec import Objective
from services.tuner.trial import Alert, TrialOutcome

pytestmark = pytest.mark.unit

OBJECTIVE = Objective(
    constraints=[
        {"metric": "kl_ref", "reduce": "max", "below": 0.5},
        {"metric": "entropy", "reduce": "final", "above": 0.2},
        {"no_alert": "warning"},
        {"metric": "response_len", "reduce": "mean", "below": 40},
    ]
)


def outcome(status: str = "complete", alerts: tuple[Alert, ...] = (), **series: list[float]) -> TrialOutcome:
    return TrialOutcome(
        status=status,
        reason="",
        exit_code=0,
        steps=3,
        values=[],
        series=series,
        final_metrics={},
        alerts=list(alerts),
        peak_rss_gb=1.0,
        peak_gpu_gb=None,
        wall_s=10.0,
    )


def test_each_rule_is_named_in_the_order_its_value_is_told():
    assert constraint_names(OBJECTIVE) == ["oom", "0:kl_ref", "1:entropy", "2:no_alert_warning", "3:response_len"]
    assert feasible(OBJECTIVE) == [0.0] * 5


def test_a_trial_within_every_bound_is_feasible_by_its_margins():
    values = constraint_values(
        OBJECTIVE,
        outcome(kl_ref=[0.1, 0.4, 0.2], entropy=[0.9, 0.5], response_len=[30, 34]),
    )
    assert values == pytest.approx([0.0, 0.4 - 0.5, 0.2 - 0.5, 0.0, 32 - 40])


def test_a_broken_bound_an_alert_at_or_above_the_severity_and_out_of_memory_each_count_against_it():
    alerts = (Alert("kl_spike", "warning", 2), Alert("nan_loss", "critical", 3), Alert("slow", "info", 1))
    values = constraint_values(
        OBJECTIVE,
        outcome("oom", alerts, kl_ref=[0.1, 0.9], entropy=[0.9, 0.05], response_len=[50]),
    )
    assert values == pytest.approx([1.0, 0.9 - 0.5, 0.2 - 0.05, 2.0, 50 - 40])


def test_a_metric_the_run_never_wrote_breaks_its_rule():
    values = constraint_values(OBJECTIVE, outcome(kl_ref=[0.1]))
    assert values == pytest.approx([0.0, 0.1 - 0.5, 1.0, 0.0, 1.0])
