"""What a finished (or stopped) run leaves for its operator: the cost record, the PNG and HTML reports, and the
summary table the launcher prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.table import Table

from services.cli.report import read_jsonl, time_lines, write_run_report
from services.common.config import RunConfig
from services.common.files import write_atomically
from services.common.observe.usage import USAGE_FILE, RunCost, UsageMeter


def run_cost(cfg: RunConfig, done: dict[str, Any], usage: UsageMeter) -> RunCost:
    """The run's device-hours and cost, also written to runs/<run>/usage.json for the report."""
    baseline, final = done.get("baseline_accuracy"), done.get("final_accuracy")
    cost = RunCost(
        device_hours=usage.device_hours(),
        prices=dict(cfg.cost.per_device_hour),
        steps=int(done.get("steps") or 0),
        accuracy_gain=None if baseline is None or final is None else final - baseline,
    )
    write_atomically(cfg.run_dir / USAGE_FILE, json.dumps(cost.as_record(), indent=2).encode())
    return cost


def summarize(
    cfg: RunConfig, done: dict[str, Any], startup: dict[str, float], wall_s: float, cost: RunCost | None = None
) -> Table:
    rows = read_jsonl(cfg.metrics_file)
    steps = [r for r in rows if "reward_mean" in r]
    table = Table(title=f"run {cfg.run_id}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    baseline, final = done.get("baseline_accuracy"), done.get("final_accuracy")
    if baseline is not None and final is not None:
        table.add_row("eval accuracy (start -> end)", f"{baseline:.3f} -> {final:.3f}  ({final - baseline:+.3f})")
    table.add_row("steps", str(done.get("steps")))
    if steps:
        first, last = steps[: max(len(steps) // 10, 1)], steps[-max(len(steps) // 10, 1) :]
        for key in ("reward_mean", "entropy", "kl_ref", "response_length_mean", "termination_rate"):
            table.add_row(f"{key} (first -> last 10%)", f"{_mean(first, key):.4f} -> {_mean(last, key):.4f}")
        filtered = [r["dynamic_sampling/dropped_fraction"] for r in steps if "dynamic_sampling/dropped_fraction" in r]
        if filtered:
            table.add_row("groups filtered by dynamic sampling (mean share)", f"{sum(filtered) / len(filtered):.3f}")
        completions = sum(r["completions"] for r in steps)
        table.add_row("completions/s (training wall time)", f"{completions / max(wall_s, 1e-9):.1f}")
    table.add_row("wall time", f"{wall_s:.1f}s")
    table.add_row("ready (s after launch)", ", ".join(f"{k} {v:.1f}" for k, v in startup.items()))
    for quantity, value in time_lines(rows):
        table.add_row(quantity, value)
    for quantity, value in cost.lines() if cost else ():
        table.add_row(quantity, value)
    return table


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def write_reports(cfg: RunConfig) -> Path:
    """The run's PNG report (returned) and its HTML page, from whatever metrics it has."""
    report, _ = write_run_report(cfg.run_dir, cfg.metrics_file)
    return report
