"""``rlpipe alerts review RUN``: each alert rule against what the run actually showed, and a threshold to suggest.

Thresholds are set before a run, from guesses; the guide asks that they be reviewed against real runs. For each
rule of the run's config this reads the run's step rows and alert events and reports how often the rule fired, the
distribution of what it judges over the run, and the closest the run came to firing it: for ``above`` the highest
minimum of any window of ``window_steps`` rows (the rule fires when a whole window is beyond the threshold), for
``below`` the lowest maximum, for ``rises_by``/``falls_by`` the largest relative change of one window's mean over
the window before (the evaluator's own formula, services/trainer/alerts.py), for ``absent`` the longest gap between
rows carrying the metric. The suggestion puts the threshold a margin beyond that point: a rule that fired on a run
the operator judges healthy is too tight, and one the run never came near may be too loose to catch anything. It is
a suggestion for a healthy run, never applied by itself.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.common.config import AlertRule

MARGIN = 0.2  # how far beyond the run's closest approach a suggested threshold goes (relative)
PERCENTILES = (1, 5, 50, 95, 99)


@dataclass(frozen=True)
class RuleReview:
    """One rule against one run."""

    rule: AlertRule
    firings: list[int | None]  # the step of each firing, in order
    observed: int  # values (or windows, or gaps) the distribution is over
    percentiles: dict[int, float]  # of the metric; of the relative change for rises_by/falls_by; of gaps for absent
    closest: float | None  # the run's closest approach to firing (see the module docstring); None: nothing judged
    suggested: float | None  # a threshold MARGIN beyond it, in the rule's unit; None: no suggestion

    @property
    def verdict(self) -> str:
        if self.closest is None:
            return "not judged: the run never carried the metric long enough"
        if self.firings:
            return f"fired {len(self.firings)} time(s): loosen it if the run was healthy"
        if self.suggested is not None and _tighter(self.rule, self.suggested):
            return "never came near: it may be too loose to catch trouble"
        return "quiet, with the run close enough to it that it would catch a real change"


def _tighter(rule: AlertRule, suggested: float) -> bool:
    """Whether ``suggested`` is much tighter than the rule's own threshold (the run stayed far from it)."""
    current = rule.window_s if rule.condition == "absent" else rule.threshold
    if rule.condition == "below":
        return suggested > current * (1 + MARGIN) if current > 0 else suggested > current + MARGIN
    return suggested < current * (1 - MARGIN)


def _windows(values: Sequence[float], size: int) -> list[Sequence[float]]:
    return [values[i : i + size] for i in range(len(values) - size + 1)]


def relative_changes(values: Sequence[float], window: int) -> list[float]:
    """``(new_mean - old_mean) / |old_mean|`` of each pair of adjacent windows, as the evaluator computes it."""
    changes = []
    for end in range(2 * window, len(values) + 1):
        old = sum(values[end - 2 * window : end - window]) / window
        new = sum(values[end - window : end]) / window
        if math.isfinite(old) and math.isfinite(new) and old != 0:
            changes.append((new - old) / abs(old))
    return changes


def review_rule(
    rule: AlertRule, series: Sequence[tuple[float, float]], firings: list[int | None], margin: float = MARGIN
) -> RuleReview:
    """``rule`` against ``series``, the (time, value) of each row carrying its metric in order, and its firings."""
    values = [value for _, value in series if math.isfinite(value)]
    judged: list[float]
    closest: float | None = None
    suggested: float | None = None
    if rule.condition in ("above", "below"):
        judged = values
        windows = _windows(values, rule.window_steps)
        if windows:
            if rule.condition == "above":
                closest = max(min(window) for window in windows)
                suggested = closest + margin * abs(closest)
            else:
                closest = min(max(window) for window in windows)
                suggested = closest - margin * abs(closest)
    elif rule.condition in ("rises_by", "falls_by"):
        changes = relative_changes(values, rule.window_steps)
        judged = changes if rule.condition == "rises_by" else [-change for change in changes]
        if judged:
            closest = max(judged)
            suggested = max(closest, 0.0) * (1 + margin) + margin
    elif rule.condition == "absent":
        times = [time for time, _ in series]
        judged = [later - earlier for earlier, later in itertools.pairwise(times)]
        if judged:
            closest = max(judged)
            suggested = closest * (1 + margin) * 2  # a gap twice the longest seen, so a slow step is no outage
    else:  # nan: nothing to tune; the closest approach is how many values were not finite
        judged = values
        closest = float(len(series) - len(values))
    percentiles = {p: float(np.percentile(np.asarray(judged, dtype=float), p)) for p in PERCENTILES} if judged else {}
    return RuleReview(rule, firings, len(judged), percentiles, closest, suggested)


def review_run(rules: Sequence[AlertRule], rows: Sequence[dict], events: Sequence[dict]) -> list[RuleReview]:
    """Every rule against a run: ``rows`` its metrics.jsonl, ``events`` its events.jsonl (alert firings by rule)."""
    reviews = []
    for rule in rules:
        series = [
            (float(row.get("time", 0.0)), float(row[rule.metric]) if row[rule.metric] is not None else math.nan)
            for row in rows
            if rule.metric in row and isinstance(row[rule.metric], int | float | None)
        ]
        firings = [
            event.get("step") for event in events if event.get("kind") == "alert" and event.get("rule") == rule.name
        ]
        reviews.append(review_rule(rule, series, firings))
    return reviews
