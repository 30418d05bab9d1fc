"""What a run used, per role, and what it cost: CPU core-hours and GPU-hours, priced per device-hour.

``rlpipe run`` samples its children while the run goes (``UsageMeter.sample``): each process's CPU time from
/proc (utime + stime, the kernel's own count, so a sleeping process costs nothing) and, where NVML is present,
which GPUs hold the process (each GPU a process holds counts its wall time as a GPU-hour, busy or not: a held GPU
is a paid GPU). A restarted process starts a new count; the role's total is the sum of all its processes.

Each sample also reads every process's resident memory and, where it holds GPUs, the device memory NVML says it
uses and how busy those GPUs are. Once the run's first step is done (``settle``: the optimizer, the engines' caches
and the first batch's buffers are allocated), each running process's memory then is its settled memory;
``resource_trends`` gives it beside the last reading, with the busiest its GPUs were since, for ``rlpipe verify`` to
tell a leak or an idle GPU in any role.

``RunCost`` turns the totals into what an operator budgets with: device-hours per role and, with
``cost.per_device_hour`` set, the cost of the run, per training step and per held-out accuracy point gained
(one point = 0.01 accuracy).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.observe.hardware import initialized_nvml, nvml_or

CPU_CORE, GPU = "cpu-core", "gpu"  # the device kinds cost.per_device_hour prices
USAGE_FILE = "usage.json"  # in the run directory: RunCost.as_record(), read by the report and the tuner
# What a finished run's usage.json says as single numbers, by name (a tune file names them "usage.<name>"); the
# priced ones exist only with cost.per_device_hour set.
PRICED_QUANTITIES = ("cost", "cost_per_step", "cost_per_accuracy_point")
RUN_QUANTITIES = (*PRICED_QUANTITIES, "cpu_core_hours", "gpu_hours")


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # Fields 14 and 15 of stat (utime, stime), counted from the ")" that ends the command name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_rss_gib(pid: int) -> float | None:
    """Resident memory of process ``pid`` in GiB; None once it is gone."""
    try:
        resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def with_descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun's ranks, an engine's workers), as /proc lists them now."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                todo += [int(child) for child in children.read_text().split()]
    return found


@dataclass(frozen=True)
class GpuHold:
    """What one process holds on the GPUs, as NVML shows it at one sample."""

    devices: int  # GPUs it holds (compute or graphics contexts)
    mem_gib: float | None  # device memory it uses over them; None where NVML does not say (some vGPUs, containers)
    util_pct: float  # the busiest of those GPUs over NVML's last sample period


def gpu_holders() -> dict[int, GpuHold]:
    """pid -> what that process holds on the GPUs; empty without NVML.

    A query NVML refuses leaves out what it would have told (``nvml_or``) rather than raise: the launcher samples
    this every two seconds from its loop."""
    nvml = initialized_nvml()
    if nvml is None:
        return {}
    held: dict[int, GpuHold] = {}
    for index in range(nvml_or(nvml, 0, nvml.nvmlDeviceGetCount)):
        handle = nvml_or(nvml, None, nvml.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            continue
        used: dict[int, int | None] = {}
        for process in [
            *nvml_or(nvml, [], nvml.nvmlDeviceGetComputeRunningProcesses, handle),
            *nvml_or(nvml, [], nvml.nvmlDeviceGetGraphicsRunningProcesses, handle),
        ]:
            used[process.pid] = _plus(used.get(process.pid, 0), process.usedGpuMemory)
        rates = nvml_or(nvml, None, nvml.nvmlDeviceGetUtilizationRates, handle) if used else None
        util = 0.0 if rates is None else float(rates.gpu)
        for pid, memory in used.items():
            before = held.get(pid, GpuHold(0, 0.0, 0.0))
            gib = None if memory is None or before.mem_gib is None else before.mem_gib + memory / 2**30
            held[pid] = GpuHold(before.devices + 1, gib, max(before.util_pct, util))
    return held


def _plus(total: int | None, more: int | None) -> int | None:
    """Bytes added up, None as soon as one reading is missing (NVML gives None where it cannot tell)."""
    return None if total is None or more is None else total + more


@dataclass
class _Process:
    role: str
    cpu_s: float = 0.0  # as last read
    gpu_s: float = 0.0  # GPU-seconds held so far
    seen: float | None = None  # when it was last sampled
    rss_gib: float | None = None  # as last read
    settled_rss_gib: float | None = None  # read when the run's first step was done
    gpu_gib: float | None = None  # device memory as last read; None while it holds no GPU or NVML cannot tell
    settled_gpu_gib: float | None = None  # device memory when the run's first step was done
    gpu_util_peak_pct: float | None = None  # the busiest its GPUs were at a sample since then; None: no GPU held


@dataclass(frozen=True)
class ResourceTrend:
    """One process's resident memory from the first reading after the run's first step to the last, and where it
    holds GPUs their memory over the same span and how busy they were."""

    role: str
    pid: int
    settled_gib: float
    last_gib: float
    settled_gpu_gib: float | None = None  # None: no GPU held when the first step was done, or NVML cannot tell
    last_gpu_gib: float | None = None
    gpu_util_peak_pct: float | None = None  # None: no GPU held at any sample after the first step


@dataclass
class UsageMeter:
    """Per-role device seconds of a run's processes, from periodic samples."""

    processes: dict[int, _Process] = field(default_factory=dict)  # by pid: a restart is a new process

    def sample(self, pids: dict[int, str], now: float, gpus: dict[int, GpuHold] | None = None) -> None:
        """Read each running process of ``pids`` (pid -> role) at time ``now``; ``gpus`` is ``gpu_holders()``."""
        gpus = gpu_holders() if gpus is None else gpus
        for pid, role in pids.items():
            cpu = process_cpu_seconds(pid)
            if cpu is None:
                continue  # exited: its last reading stands
            process = self.processes.setdefault(pid, _Process(role))
            process.cpu_s = cpu
            hold = gpus.get(pid)
            if process.seen is not None and hold is not None:
                process.gpu_s += hold.devices * (now - process.seen)
            process.seen = now
            process.rss_gib = process_rss_gib(pid)
            process.gpu_gib = None if hold is None else hold.mem_gib
            if hold is not None and process.settled_rss_gib is not None:
                process.gpu_util_peak_pct = max(process.gpu_util_peak_pct or 0.0, hold.util_pct)

    def settle(self, gpus: dict[int, GpuHold] | None = None) -> None:
        """The run's first step is done: each process sampled so far and still running has its memory (host, and
        device where it holds GPUs) read now as its settled memory. One started later (a restart) is still loading
        then, so it has none."""
        gpus = gpu_holders() if gpus is None else gpus
        for pid, process in self.processes.items():
            if process.settled_rss_gib is None and (rss := process_rss_gib(pid)) is not None:
                process.settled_rss_gib = process.rss_gib = rss
                if (hold := gpus.get(pid)) is not None:
                    process.settled_gpu_gib = process.gpu_gib = hold.mem_gib
                    process.gpu_util_peak_pct = hold.util_pct

    def resource_trends(self) -> list[ResourceTrend]:
        """Every process with a settled reading, from it to its last."""
        return [
            ResourceTrend(p.role, pid, p.settled_rss_gib, p.rss_gib, p.settled_gpu_gib, p.gpu_gib, p.gpu_util_peak_pct)
            for pid, p in self.processes.items()
            if p.settled_rss_gib is not None and p.rss_gib is not None
        ]

    def device_hours(self) -> dict[str, dict[str, float]]:
        """role -> {"cpu-core": core-hours, "gpu": GPU-hours}."""
        hours: dict[str, dict[str, float]] = {}
        for process in self.processes.values():
            role = hours.setdefault(process.role, {CPU_CORE: 0.0, GPU: 0.0})
            role[CPU_CORE] += process.cpu_s / 3600
            role[GPU] += process.gpu_s / 3600
        return hours


@dataclass(frozen=True)
class RunCost:
    """A run's device-hours per role, and its cost where prices are known."""

    device_hours: dict[str, dict[str, float]]  # role -> device kind -> hours
    prices: dict[str, float]  # device kind -> cost per hour (cost.per_device_hour)
    steps: int
    accuracy_gain: float | None  # final minus baseline held-out accuracy (0..1), None without both

    @property
    def total(self) -> float | None:
        """The run's cost, or None when no device kind it used has a price."""
        used = {kind for kinds in self.device_hours.values() for kind, hours in kinds.items() if hours > 0}
        if not used or not used <= self.prices.keys():
            return None
        return sum(
            hours * self.prices[kind] for kinds in self.device_hours.values() for kind, hours in kinds.items() if hours
        )

    @property
    def per_step(self) -> float | None:
        return None if self.total is None or self.steps <= 0 else self.total / self.steps

    @property
    def per_accuracy_point(self) -> float | None:
        """Cost per held-out accuracy point gained (0.01 accuracy); None without a gain to divide by."""
        if self.total is None or self.accuracy_gain is None or self.accuracy_gain <= 0:
            return None
        return self.total / (self.accuracy_gain * 100)

    def lines(self) -> list[tuple[str, str]]:
        """(quantity, value) rows for the run summary and the report."""
        rows = []
        for role in sorted(self.device_hours):
            kinds = self.device_hours[role]
            used = ", ".join(f"{kinds[kind]:.4f} {kind}-h" for kind in (CPU_CORE, GPU) if kinds.get(kind, 0) > 0)
            rows.append((f"device-hours: {role}", used or "0"))
        if self.total is None:
            priced = ", ".join(sorted(self.prices)) or "none"
            rows.append(("cost", f"not priced (cost.per_device_hour has {priced})"))
            return rows
        rows.append(("cost", f"{self.total:.4f}"))
        if self.per_step is not None:
            rows.append(("cost per step", f"{self.per_step:.6f}"))
        gained = "no held-out gain" if self.per_accuracy_point is None else f"{self.per_accuracy_point:.4f}"
        rows.append(("cost per held-out accuracy point", gained))
        return rows

    def as_record(self) -> dict:
        """usage.json in the run directory: what the report reads."""
        return {
            "device_hours": self.device_hours,
            "prices": self.prices,
            "steps": self.steps,
            "accuracy_gain": self.accuracy_gain,
            "cost": self.total,
            "cost_per_step": self.per_step,
            "cost_per_accuracy_point": self.per_accuracy_point,
        }


def run_quantities(record: dict[str, Any]) -> dict[str, float | None]:
    """``RUN_QUANTITIES`` of a usage.json record: None where the run had no price or no held-out gain."""
    hours = record["device_hours"]
    return {
        **{name: record.get(name) for name in PRICED_QUANTITIES},
        "cpu_core_hours": sum(kinds.get(CPU_CORE, 0.0) for kinds in hours.values()),
        "gpu_hours": sum(kinds.get(GPU, 0.0) for kinds in hours.values()),
    }
