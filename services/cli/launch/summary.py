"""What a finished (or stopped) run leaves for its operator: the cost record, the PNG and HTML reports, and the
summary table the launcher prints."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from services.cli.report import time_lines, write_run_report
from services.common.config import RunConfig
from services.common.files import write_atomically
from services.common.observe import metrics as m
from services.common.observe.metric_types import Metric
from services.common.observe.records import MetricsRow, RunDone, read_metrics
from services.common.observe.usage import USAGE_FILE, RunCost, UsageMeter

# The step statistics the summary shows at the start and the end of the run.
TRENDS = (m.REWARD_MEAN, m.ENTROPY, m.KL_REF, m.RESPONSE_LENGTH_MEAN, m.TERMINATION_RATE)


def run_cost(cfg: RunConfig, done: RunDone | None, usage: UsageMeter) -> RunCost:
    """The run's device-hours and cost, also written to runs/<run>/usage.json for the report; ``done``: the
    trainer's ``done`` event, None for a run stopped before it."""
    cost = RunCost(
        device_hours=usage.device_hours(),
        prices={**cfg.cost.per_device_hour},
        steps=done.steps if done else 0,
        accuracy_gain=done.accuracy_gain if done else None,
    )
    write_atomically(cfg.run_dir / USAGE_FILE, json.dumps(cost.as_record(), indent=2).encode())
    return cost


def summarize(
    cfg: RunConfig, done: RunDone | None, startup: dict[str, float], wall_s: float, cost: RunCost | None = None
) -> Table:
    rows = read_metrics(cfg.metrics_file)
    steps = [row for row in rows if row.is_step]
    table = Table(title=f"run {cfg.run_id}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    if done is not None and done.baseline_accuracy is not None and done.final_accuracy is not None:
        baseline, final = done.baseline_accuracy, done.final_accuracy
        table.add_row("eval accuracy (start -> end)", f"{baseline:.3f} -> {final:.3f}  ({final - baseline:+.3f})")
    table.add_row("steps", str(done.steps if done else None))
    if steps:
        first, last = steps[: max(len(steps) // 10, 1)], steps[-max(len(steps) // 10, 1) :]
        for metric in TRENDS:
            table.add_row(
                f"{metric.key} (first -> last 10%)", f"{_mean(first, metric):.4f} -> {_mean(last, metric):.4f}"
            )
        filtered = [share for row in steps if (share := row.get(m.DYNAMIC_SAMPLING_DROPPED)) is not None]
        if filtered:
            table.add_row("groups filtered by dynamic sampling (mean share)", f"{sum(filtered) / len(filtered):.3f}")
        completions = sum(row[m.COMPLETIONS] for row in steps)
        table.add_row("completions/s (training wall time)", f"{completions / max(wall_s, 1e-9):.1f}")
    table.add_row("wall time", f"{wall_s:.1f}s")
    table.add_row("ready (s after launch)", ", ".join(f"{k} {v:.1f}" for k, v in startup.items()))
    for quantity, value in time_lines(rows):
        table.add_row(quantity, value)
    for quantity, value in cost.lines() if cost else ():
        table.add_row(quantity, value)
    return table


def _mean(rows: list[MetricsRow], metric: Metric) -> float:
    return sum(row[metric] for row in rows) / len(rows)


def write_reports(cfg: RunConfig) -> Path:
    """The run's PNG report (returned) and its HTML page, from whatever metrics it has."""
    report, _ = write_run_report(cfg.run_dir, cfg.metrics_file)
    return report
