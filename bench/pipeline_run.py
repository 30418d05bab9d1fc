"""Driving a whole ``rlpipe run`` for a benchmark, and reading the machine around it: each process's CPU while the
run goes, the cores' busy fraction before it, and the CPU model for the record. Used by bench/throughput.py and
bench/vs_trl.py."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TypedDict

from services.common.observe import metrics as m
from services.common.observe.records import MetricsRow, read_metrics, step_rows

ROOT = Path(__file__).resolve().parent.parent


class CpuSampler:
    """Each process's CPU seconds (utime + stime from /proc) as last seen, sampled on a thread while a run goes."""

    def __init__(self, run_json: Path, interval_s: float = 0.5):
        self.run_json, self.interval_s = run_json, interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []  # (wall time, {service: cpu seconds})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(self.interval_s):
            try:
                pids = json.loads(self.run_json.read_text())["pids"]
            except (OSError, ValueError, KeyError):
                continue  # not written yet, or mid-write
            cpu = {}
            for name, pid in pids.items():
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # exited
                # Fields 14 and 15 (utime, stime) counted from the ")" that ends the command name.
                cpu[name] = (int(fields[11]) + int(fields[12])) / ticks
            self.samples.append((time.time(), cpu))

    def shares(self, start: float, end: float) -> dict[str, float]:
        """Each process's CPU seconds per wall second between ``start`` and ``end`` (1.0 = one core)."""
        inside = [(t, cpu) for t, cpu in self.samples if start <= t <= end]
        if len(inside) < 2:
            return {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        return {name: round((last[name] - first[name]) / (t1 - t0), 3) for name in last if name in first}


def demo_overrides(run_dir: Path, model: Path, data: Path, steps: int) -> list[str]:
    """The overrides that run examples/arith-grpo.yaml as a bench run: its id and folder, the model and data
    named, ``steps`` steps with one evaluation (of 100 rows) and one save at the end."""
    return [
        f"run_id={run_dir.name}",
        f"runs_dir={run_dir.parent}",
        f"model.path={model}",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.eval_path={data / 'eval.jsonl'}",
        "data.eval_size=100",
        f"data.eval_every_steps={steps}",
        f"train.total_steps={steps}",
        f"checkpoint.save_every_steps={steps}",
    ]


def run_pipeline(config: Path, overrides: list[str], run_dir: Path, steps: int) -> list[MetricsRow]:
    """``rlpipe run config overrides`` to its end; the run's metrics rows. Its output goes to ``<run_dir>.log``.

    A nonzero exit after every step was recorded (a service slow to stop on a loaded machine) is reported
    and the run used; a run that recorded fewer steps raises."""
    log = run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)  # runs_dir: rlpipe run creates it, but only once it starts
    with log.open("w") as out:
        # python -m, not the rlpipe script: the services run from this tree, whichever one .venv installed.
        command = [sys.executable, "-m", "services.cli", "run", str(config), *overrides, "--overwrite"]
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    rows = read_metrics(run_dir / "metrics.jsonl")
    recorded = {row.step for row in step_rows(rows)}
    if len(recorded) < steps:
        raise RuntimeError(f"rlpipe run exited {code} after {len(recorded)} of {steps} steps; see {log}")
    if code != 0:
        print(f"note: rlpipe run exited {code} after recording all {steps} steps (see {log}); its metrics are used")
    return rows


def steady_steps(rows: list[MetricsRow], skip: int) -> list[MetricsRow]:
    """The step rows in step order, less the first ``skip`` (start-up and the first weight syncs)."""
    return sorted(step_rows(rows), key=lambda row: row[m.STEP])[skip:]


class TimeSplit(TypedDict):
    step_wall_s_by_phase: dict[str, float]  # "time/<phase>" -> mean seconds per step
    role_time_shares: dict[str, dict[str, float]]  # role -> activity -> fraction, at the last step


def where_the_time_went(steady: list[MetricsRow]) -> TimeSplit:
    """The mean wall seconds per step by phase, and each role's busy/idle/blocked fractions at the last step."""
    phases = sorted((phase for phase in m.TIME_SPLIT.members() if phase in steady[-1]), key=lambda phase: phase.key)
    shares: dict[str, dict[str, float]] = {}
    for (role, activity), value in steady[-1].family(m.TIME_SHARE).items():
        shares.setdefault(role, {})[activity] = value
    split = {phase.key: round(statistics.fmean(row[phase] for row in steady), 4) for phase in phases}
    return {"step_wall_s_by_phase": split, "role_time_shares": shares}


def cpu_busy_fraction(seconds: float) -> float:
    """The fraction of all cores' time spent busy (not idle or waiting on I/O) over ``seconds``, from /proc/stat."""

    def totals() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields), idle

    total_a, idle_a = totals()
    time.sleep(seconds)
    total_b, idle_b = totals()
    return 1.0 - (idle_b - idle_a) / max(total_b - total_a, 1)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"
