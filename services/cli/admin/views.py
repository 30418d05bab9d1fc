"""How the operator commands print: the status tables, a message as JSON, the run's metric rows and a service's
log, followed as they grow."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from services.cli.admin.client import USAGE, fail, plain
from services.cli.output import console_for
from services.common.observe.logs import JsonlFollower
from services.common.observe.metrics import EVAL_ACCURACY, Metric, find
from services.common.observe.records import MetricsRow
from services.common.pb import admin_pb2

# Piped output (scripts, logs) gets room for the wide tables instead of rich's 80 columns.
console = console_for(sys.stdout)


def print_json(message: Any) -> None:
    typer.echo(json.dumps(plain(message), indent=2))


def show_status(status: admin_pb2.Status, as_json: bool) -> None:
    if as_json:
        return print_json(status)
    state = f"[bold]{status.state}[/]" + (f" ({status.paused_reason})" if status.paused_reason else "")
    unreadable = f"[red]unknown: store unreadable ({status.checkpoint_store_error})[/]"

    def stored_step(step: int) -> str:
        """A step the store names: unknown while it is unreadable, "none" when it has none (-1)."""
        if status.checkpoint_store_error:
            return unreadable
        return str(step) if step >= 0 else "none"

    summary = Table(title=f"run {status.run_id}", show_header=False)
    for name, value in (
        ("state", state),
        ("step", f"{status.step} / {status.total_steps}"),
        ("policy version", str(status.policy_version)),
        ("config version", str(status.config_version)),
        ("last checkpoint", stored_step(status.last_checkpoint_step)),
        ("last stable", stored_step(status.last_stable_step)),
        ("eval accuracy", f"{status.last_eval_accuracy:.3f}" if status.last_eval_accuracy >= 0 else "-"),
        ("groups in flight", str(status.in_flight_groups)),
        ("build", f"{status.build_version} ({status.build_revision})"),
        ("environment", status.environment or "-"),
    ):
        summary.add_row(name, value)
    console.print(summary)
    services = Table(title="services")
    for column in ("instance", "role", "up", "restarts", "lag", "policy v", "config v", "GPU GiB alloc/resv/used"):
        services.add_column(column)
    for column in ("grpc", "metrics", "seen"):
        services.add_column(column)
    for s in status.services:
        services.add_row(
            s.instance,
            s.role,
            service_state(s),
            str(s.restarts),
            str(s.consumer_lag),
            str(s.policy_version) if s.role in ("trainer", "rollout") else "-",  # the others hold no policy
            str(s.config_version),
            gpu_memory_cell(s),
            s.grpc_address,
            s.metrics_url,
            f"{s.last_seen_s:.0f}s ago",
        )
    console.print(services)
    if status.alerts:
        alerts = Table(title="active alerts")
        for column in ("rule", "severity", "metric", "value", "threshold", "window", "step", "actions"):
            alerts.add_column(column)
        for a in status.alerts:
            alerts.add_row(
                a.rule,
                a.severity,
                a.metric,
                f"{a.value:.4g}",
                f"{a.threshold:.4g}",
                a.window,
                str(a.step),
                ",".join(a.actions),
            )
        console.print(alerts)


def service_state(service: admin_pb2.ServiceStatus) -> str:
    """up, down (stopped beating: killed, hung, or out of reach), or stopped (ended in order: scaled in, stopped)."""
    if service.up:
        return "[green]up[/]"
    return "[dim]stopped[/]" if service.stopped else "[red]down[/]"


def gpu_memory_cell(service: admin_pb2.ServiceStatus) -> str:
    """A replica's GPU memory as ``allocated / reserved / used`` GiB, "-" for a figure it does not report (no
    CUDA in the process, no NVML), "-" alone for a replica on a CPU."""
    figures = (service.gpu_allocated_gib, service.gpu_reserved_gib, service.gpu_used_gib)
    if not any(figures):
        return "-"
    return " / ".join(f"{gib:.2f}" if gib else "-" for gib in figures)


def run_dir_of(ctx: typer.Context) -> Path:
    run_dir = ctx.obj.run_dir
    if run_dir is None:
        fail(USAGE, "no run directory found (give --run-dir)")
    return run_dir


def declared(key: str) -> Metric:
    metric = find(key)
    if metric is None:
        fail(USAGE, f"{key!r} is not a metric the trainer writes (docs/metrics.md lists them)")
    return metric


def metric_line(line: str, columns: list[Metric]) -> str | None:
    try:
        values = json.loads(line)
    except ValueError:
        return None
    if not isinstance(values, dict):
        return None
    row = MetricsRow(values)
    if not row.is_step and not row.is_eval:
        return None
    shown = [f"{metric.key}={_shown(row, metric)}" for metric in columns if metric in row]
    if row.is_eval:
        shown.append(f"eval_accuracy={row[EVAL_ACCURACY]:.4f}")
    return "  ".join(shown)


def _shown(row: MetricsRow, metric: Metric) -> str:
    value = row.get(metric)
    if value is None:
        return str(row.text(metric))
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def tail(path: Path, follow: bool, render: Callable[[str], str | None]) -> None:
    if not path.is_file():
        fail(USAGE, f"{path} does not exist")
    follower = JsonlFollower(path)  # through the record's rolled parts too
    while True:
        for line in follower.new_lines():
            shown = render(line.decode())
            if shown:
                typer.echo(shown)
        if not follow:
            return
        time.sleep(0.5)
