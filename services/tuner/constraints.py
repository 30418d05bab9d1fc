"""A trial's feasibility as Optuna constraints: one value per rule, <= 0 where the rule holds.

Index 0 is out of memory (a property of the configuration, so a trial that ran out is feasible for
nothing, whatever it reached); then the tune file's constraints in the order it lists them. TPE ranks
every trial with a positive value below every feasible one. Pure functions of the spec and a trial's
outcome, so each rule is tested without a study.
"""

from __future__ import annotations

from services.tuner.spec import AlertConstraint, Objective
from services.tuner.trial import TrialOutcome

SEVERITY = {"info": 0, "warning": 1, "critical": 2}


def constraint_names(objective: Objective) -> list[str]:
    """The names the values are told to Optuna under, in the values' order."""
    names = ["oom"]
    for i, c in enumerate(objective.constraints):
        names.append(f"{i}:no_alert_{c.no_alert}" if isinstance(c, AlertConstraint) else f"{i}:{c.metric}")
    return names


def feasible(objective: Objective) -> list[float]:
    """Every rule holding: for a trial that never had its chance to break one (interrupted, duplicated)."""
    return [0.0] * (1 + len(objective.constraints))


def constraint_values(objective: Objective, outcome: TrialOutcome) -> list[float]:
    """Per rule: how far past its bound the trial went (> 0 breaks it); a metric never measured breaks it."""
    values = [1.0 if outcome.status == "oom" else 0.0]
    for c in objective.constraints:
        if isinstance(c, AlertConstraint):
            worst = SEVERITY[c.no_alert]
            values.append(float(sum(1 for a in outcome.alerts if SEVERITY.get(a.severity, 0) >= worst)))
            continue
        series = outcome.series.get(c.metric, [])
        if not series:
            values.append(1.0)  # never measured: cannot be shown to hold
            continue
        reduced = {
            "final": series[-1],
            "max": max(series),
            "min": min(series),
            "mean": sum(series) / len(series),
        }[c.reduce]
        if c.below is not None:
            values.append(reduced - c.below)
        elif c.above is not None:
            values.append(c.above - reduced)
        else:  # Constraint refuses one without a bound
            raise ValueError(f"constraint on {c.metric} has no bound")
    return values
