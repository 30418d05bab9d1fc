"""One trial: ``rlpipe run`` of its own config in its own session, followed until it ends or is ended.

The tuner learns progress from the run's ``metrics.jsonl`` and ``events.jsonl`` (the channels the
launcher writes for tools), never from its log lines. Each poll decides, in this order:

- host RSS of the trial's process group past ``trial.max_rss_gb`` (or device memory past
  ``max_gpu_gb``): ``oom``, the group is killed at once (waiting for a graceful stop could take the
  machine down with it);
- past its wall-clock deadline: ``timeout``;
- a NaN loss, or a pause (the default ``nan_loss`` alert pauses a run; nobody resumes a trial):
  ``failed``;
- the pruner, fed each new objective value: ``pruned``;
- the launcher exited: ``complete`` if the trainer finished its steps, else ``failed`` with the cause
  (a crash, a start that failed, an alert that stopped it).

A trial that is ended gets SIGTERM on its launcher (which stops its services in order) and, after
``trial.stop_grace_s``, SIGKILL on its whole process group. Either way the group is checked empty
before the trial is recorded.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from services.common.observe import metrics as m
from services.common.observe.events import Event
from services.common.observe.logs import JsonlFollower
from services.common.observe.metrics import find
from services.common.observe.records import MetricsRow, event_records, metrics_rows
from services.common.observe.usage import USAGE_FILE, run_quantities
from services.tuner.procs import (
    GpuMemory,
    die_with_parent,
    environ_value,
    group_members,
    group_rss_bytes,
    kill_group,
    signal_group,
)
from services.tuner.spec import USAGE_PREFIX, Objective, TrialLimits

Status = Literal["complete", "pruned", "timeout", "oom", "failed"]
GB = 1024**3


@dataclass
class Alert:
    rule: str
    severity: str
    step: int | None


@dataclass
class TrialOutcome:
    status: Status
    reason: str
    exit_code: int | None
    steps: int
    values: list[tuple[int, float]]  # the objective metric, (step, value), in the order the run wrote them
    series: dict[str, list[float]]  # the values of each metric a constraint names
    final_metrics: dict[str, float]
    alerts: list[Alert]
    peak_rss_gb: float
    peak_gpu_gb: float | None
    wall_s: float
    leftover_pids: list[int] = field(default_factory=list)  # alive after the launcher exited; killed


def reduce_values(values: list[float], objective: Objective) -> float | None:
    """The objective of a trial from its metric values so far (also what the pruner sees at each step)."""
    if not values:
        return None
    if objective.reduce == "final":
        return values[-1]
    if objective.reduce == "best":
        return max(values) if objective.direction == "maximize" else min(values)
    tail = values[-objective.k :]
    return sum(tail) / len(tail)


def _last_message(path: Path, limit: int = 400) -> str:
    """The launcher's last log message, unwrapped: rich wraps it to the terminal's width and adds its source."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    stamps = list(re.finditer(r"^\[\d\d:\d\d:\d\d\] ", text, re.MULTILINE))
    last = text[stamps[-1].end() :] if stamps else text
    last = re.sub(r"\s\S+\.py:\d+\s", " ", last)
    return " ".join(last.split())[-limit:]


class TrialProcess:
    """Launch and follow one ``rlpipe run``; ``run()`` returns how it ended."""

    def __init__(
        self,
        config_path: Path,
        run_dir: Path,
        total_steps: int,
        objective: Objective,
        limits: TrialLimits,
        deadline_s: float,
        deadline_reason: str,
        gpu: GpuMemory,
        tracked: set[str] | None = None,
        visible_devices: str | None = None,
    ):
        self.config_path = config_path
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.objective = objective
        self.limits = limits
        self.deadline_s = deadline_s  # wall seconds from launch this trial may run
        self.deadline_reason = deadline_reason
        self.gpu = gpu
        self.visible_devices = visible_devices  # CUDA_VISIBLE_DEVICES of the run (a device slot), else inherited
        self.log_path = run_dir.parent / f"{run_dir.name}.launcher.log"
        self.metrics = JsonlFollower(run_dir / "metrics.jsonl")
        self.events = JsonlFollower(run_dir / "events.jsonl")
        self.values: list[tuple[int, float]] = []
        self.series: dict[str, list[float]] = {name: [] for name in tracked or ()}
        self.last_step_row = MetricsRow({})
        self.last_eval = MetricsRow({})
        self.alerts: list[Alert] = []
        self.steps = 0
        self.stopped_by = ""  # an alert's or operator's stop the trainer obeyed
        self.paused = ""  # why the trainer paused, if it did
        self.new_values: list[tuple[int, float]] = []  # not yet shown to the pruner
        self.peak_rss = 0
        self.peak_gpu = 0

    def run(
        self, on_start: Callable[[int, str | None], None], should_prune: Callable[[int, float], bool]
    ) -> TrialOutcome:
        """``on_start(pgid, CUDA_VISIBLE_DEVICES)`` as the launcher's kernel-recorded environment holds it."""
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        env = None if self.visible_devices is None else {**os.environ, "CUDA_VISIBLE_DEVICES": self.visible_devices}
        with self.log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "run", str(self.config_path), "--overwrite"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: the unit the tuner measures and kills
                preexec_fn=die_with_parent,
            )
        pgid = process.pid
        on_start(pgid, environ_value(pgid, "CUDA_VISIBLE_DEVICES"))
        status: Status | None = None
        reason = ""
        while status is None:
            self.read_progress()
            rss = group_rss_bytes(pgid)
            self.peak_rss = max(self.peak_rss, rss)
            gpu_bytes = self.gpu.used_bytes({m.pid for m in group_members(pgid)}) if self.gpu.available else 0
            self.peak_gpu = max(self.peak_gpu, gpu_bytes)
            elapsed = time.monotonic() - started
            if process.poll() is not None:
                self.read_progress()
                status, reason = self.ended_by_itself(process.returncode)
                break
            if self.limits.max_rss_gb is not None and rss > self.limits.max_rss_gb * GB:
                status, reason = "oom", f"host RSS {rss / GB:.2f} GB > trial.max_rss_gb {self.limits.max_rss_gb:g}"
                kill_group(pgid)
                break
            if self.limits.max_gpu_gb is not None and gpu_bytes > self.limits.max_gpu_gb * GB:
                status = "oom"
                reason = f"device memory {gpu_bytes / GB:.2f} GB > trial.max_gpu_gb {self.limits.max_gpu_gb:g}"
                kill_group(pgid)
                break
            if elapsed > self.deadline_s:
                status, reason = "timeout", f"{self.deadline_reason} ({self.deadline_s:g}s) at step {self.steps}"
            elif (nan := self.nan_loss()) is not None:
                status, reason = "failed", f"loss is {nan} at step {self.steps}"
            elif self.paused:
                status, reason = "failed", f"paused ({self.paused}); a trial is not resumed"
            elif self.new_values:
                step = self.new_values[-1][0]
                self.new_values = []
                # The pruner compares what the objective would be if the trial ended now.
                so_far = reduce_values([value for _, value in self.values], self.objective)
                if so_far is not None and should_prune(step, so_far):
                    status, reason = "pruned", f"pruned at step {step} (objective so far {so_far:.4g})"
            if status is not None:
                self.stop(process, pgid)
                break
            time.sleep(self.limits.poll_s)
        process.wait()
        self.read_usage()
        leftovers = group_members(pgid)
        if leftovers:
            kill_group(pgid)
        final = {key: value for key, value in self.last_step_row.numbers() if key != m.TIME.key}
        if (accuracy := self.last_eval.get(m.EVAL_ACCURACY)) is not None:
            final[m.EVAL_ACCURACY.key] = accuracy
        return TrialOutcome(
            status=status,
            reason=reason,
            exit_code=process.returncode,
            steps=self.steps,
            values=self.values,
            series=self.series,
            final_metrics=final,
            alerts=self.alerts,
            # Unrounded: a peak just past the limit must not read as equal to it (the table rounds for display).
            peak_rss_gb=self.peak_rss / GB,
            peak_gpu_gb=self.peak_gpu / GB if self.gpu.available else None,
            wall_s=round(time.monotonic() - started, 2),
            leftover_pids=[m.pid for m in leftovers],
        )

    def read_progress(self) -> None:
        # None for a usage.<quantity>, read from usage.json once the run has ended (read_usage).
        objective = find(self.objective.metric)
        tracked = {name: find(name) for name in self.series}
        for row in metrics_rows(self.metrics.new_rows()):
            step = row.step
            if (rule := row.alert) is not None:
                self.alerts.append(Alert(rule, row.text(m.ALERT_SEVERITY) or "", step))
                continue
            if row.is_eval:
                self.last_eval = row
            elif row.is_step:
                self.last_step_row = row
                self.steps = max(self.steps, step or 0)
            for name, series in self.series.items():
                if (metric := tracked[name]) is not None and (value := row.get(metric)) is not None:
                    series.append(float(value))
            if objective is not None and (value := row.get(objective)) is not None:
                point = (step or 0, float(value))
                self.values.append(point)
                self.new_values.append(point)
        for event in event_records(self.events.new_rows()):
            if event.kind == Event.PAUSE:
                self.paused = event.message
            elif event.kind == Event.STOP:
                self.stopped_by = event.message

    def read_usage(self) -> None:
        """Add the ``usage.`` quantities the objective and constraints name, from the ended run's usage.json.

        The launcher writes the file as it exits; a run that never got that far has none, and a quantity it
        could not price (no held-out gain, say) stays unmeasured: a missing objective fails the trial, a missing
        constraint value makes it infeasible.
        """
        try:
            quantities = run_quantities(json.loads((self.run_dir / USAGE_FILE).read_text()))
        except (OSError, ValueError, KeyError):
            return

        def measured(metric: str) -> float | None:
            value = quantities.get(metric.removeprefix(USAGE_PREFIX)) if metric.startswith(USAGE_PREFIX) else None
            return None if value is None else float(value)

        for name, series in self.series.items():
            if (value := measured(name)) is not None:
                series.append(value)
        if (value := measured(self.objective.metric)) is not None:
            self.values.append((self.steps, value))

    def nan_loss(self) -> str | None:
        loss = self.last_step_row.get(m.LOSS)
        if isinstance(loss, float) and not math.isfinite(loss):
            return str(loss)
        return None

    def ended_by_itself(self, code: int) -> tuple[Status, str]:
        if code != 0:
            return "failed", f"rlpipe run exited with {code}: {_last_message(self.log_path)}"
        if self.stopped_by:
            return "failed", f"stopped at step {self.steps}: {self.stopped_by}"
        if self.steps < self.total_steps:
            return "failed", f"ended at step {self.steps} of {self.total_steps}: {_last_message(self.log_path)}"
        return "complete", ""

    def stop(self, process: subprocess.Popen, pgid: int) -> None:
        """SIGTERM to the launcher (it stops its services in order), SIGKILL to the group after the grace."""
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):  # then it is killed below
            process.wait(timeout=self.limits.stop_grace_s)
        signal_group(pgid, signal.SIGKILL)
        kill_group(pgid)
