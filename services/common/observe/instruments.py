"""The metrics each role records, on the meter ``telemetry.start_telemetry`` set up; every call only updates
in-memory aggregates (see telemetry.py), so none of them waits on a scrape or an export.

Names as a Prometheus scrape shows them (the exporter appends the unit and, for
counters, ``_total``; histograms come as ``_bucket``/``_sum``/``_count``):

every service (made by ``start_telemetry`` in telemetry.py)
  rlpipe_process_resident_memory_bytes                    gauge, resident set size
  rlpipe_process_cpu_seconds_total                        counter, CPU time used (core-hours per role, summed)
  rlpipe_log_records_total{level}                         log lines at warning, error or critical: the log error rate
  target_info                                             service.name rlpipe-<role>, service.instance.id, rlpipe.run_id
  rlpipe_network_bytes_total{role,channel,direction}      counter, bytes moved: channel bus (NATS payloads) |
                                                          weight_sync (tensor bytes), direction in | out
                                                          (observe/network.py); rate() is bytes per second
  rlpipe_network_link_bytes_per_second{role}              gauge, telemetry.link_mib_s (absent without it)
every service holding GPU memory (``watch_gpu_memory``, observe/gpu_memory.py; no series on a CPU)
  rlpipe_role_gpu_memory_bytes{role,kind}                 gauge, kind: allocated | reserved (torch's allocator, once
                                                          the process initialized CUDA) | used (NVML, the process and
                                                          its children, CUDA context included), read at each scrape
every service whose process NVML shows a GPU (``watch_gpus``; none without nvidia-ml-py, a driver or a GPU)
  rlpipe_gpu_utilization_percent{role,gpu,uuid}           gauge, % of NVML's last sample period a kernel ran, read
                                                          at each scrape; all processes on the GPU count
  rlpipe_gpu_memory_used_bytes{role,gpu,uuid}             gauge, device memory in use, all processes
  rlpipe_gpu_memory_total_bytes{role,gpu,uuid}            gauge, device memory
stages (rollout, reward, reference)
  rlpipe_groups_processed_total{role,edge,outcome}        outcome: ok | retry | dead
  rlpipe_stage_latency_seconds{role,edge,outcome}         histogram, fetch to ack/nak/term of one message
  rlpipe_consumer_lag{role,edge}                          gauge, messages waiting in the durable consumer
  rlpipe_dead_letters_total{role,edge,reason}             reason: undecodable | max_deliver | timeout
  rlpipe_stage_stalled{role,edge}                         gauge, 1 while the loop has made no progress for
                                                          2 * nats.max_work_s (transport/stage.py), else 0
  rlpipe_service_starts{role}                             gauge, starts of this replica's name (presence)
  rlpipe_stage_breaker_state{role,edge}                   gauge, dependency breaker: 0 closed, 1 half-open, 2 open
  rlpipe_stage_time_seconds_total{role,edge,activity}     counter, the loop's wall time by activity: busy | idle |
                                                          blocked (observe/timeshare.py); rate() of each over the
                                                          sum of the three is its fraction
reward with a remote service (``reward.http``, services/reward/remote.py)
  rlpipe_reward_http_latency_seconds{outcome}             histogram, one request to the remote reward service
  rlpipe_reward_http_errors_total{kind}                   failed requests, by kind
  rlpipe_reward_http_breaker_state                        gauge, 0 closed, 1 half-open, 2 open (groups wait)
rollout
  rlpipe_weight_sync_duration_seconds                     histogram, pull + load of one policy version
  rlpipe_weight_sync_bytes_total                          bytes of weights pulled
  rlpipe_rollout_policy_version                           gauge, version loaded in the engine
  rlpipe_rollout_env_http_latency_seconds{outcome}        histogram, one request to an HTTP environment service
  rlpipe_rollout_env_http_errors_total{kind}              its failed requests, by kind
  rlpipe_rollout_env_http_breaker_state                   gauge, 0 closed, 1 half-open, 2 open (batches wait)
trainer (``TrainerMetrics``)
  rlpipe_trainer_<key>                                    gauge per exported step-row key (``EXPORTED``,
                                                          derived from the metrics contract, metrics.py;
                                                          docs/metrics.md lists them): rlpipe_trainer_entropy,
                                                          ...; a "/" in a key becomes "_" (``gauge_name``):
                                                          memory/peak_gb -> rlpipe_trainer_memory_peak_gb
  rlpipe_trainer_nonfinite_metrics_total{metric}          step values left out because they were NaN or infinite
  rlpipe_checkpoint_duration_seconds{outcome}             histogram, outcome: ok | failed
  rlpipe_checkpoint_stall_seconds                         histogram, how long taking a checkpoint's snapshot held
                                                          the training loop (its upload runs in the background)
  rlpipe_checkpoints_total{outcome}
  rlpipe_alerts_fired_total{rule,severity}
  rlpipe_metrics_dropped_total{writer}                    metrics rows dropped, not written: the background writer's
                                                          queue was full (writer.py)
  rlpipe_trainer_groups_total{fate}                       fed groups settled: fate dead | lost | repeat (refused)
  rlpipe_disk_free_bytes{path}                            gauge, free space of the runs directory and a file:// store
  rlpipe_disk_free_saves{path}                            gauge, that free space over what one save needs (the newest
                                                          checkpoint's size, at least checkpoint.min_free_mib); an
                                                          s3:// store reports no free space, so it has no series

Every sample also carries the exporter's ``otel_scope_*`` labels.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation

from services.common.observe.gpu_memory import ProcessGpuMemory, process_gpu_memory
from services.common.observe.hardware import GpuWatch
from services.common.observe.metrics import EXPORTED
from services.common.observe.telemetry import meter
from services.common.observe.timeshare import StageActivity

# Why a message went to DEAD, as the rlpipe_dead_letters_total{reason} label (transport/settle.py's DeadCause).
DEAD_LETTER_REASONS = ("undecodable", "max_deliver", "timeout")
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SLOW_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

GROUP_FATES = ("dead", "reopened", "lost", "repeat")  # "reopened": a dead group re-injected, still counted dead


def counter(name: str, unit: str, description: str, present: Iterable[Mapping[str, str]] = ()) -> Counter:
    """A counter; each label set of ``present`` is there from the start at 0, so an ``increase()`` over it is 0
    rather than absent."""
    made = meter().create_counter(name, unit=unit, description=description)
    for attributes in present:
        made.add(0, dict(attributes))
    return made


def seconds_histogram(name: str, description: str, buckets: tuple[float, ...]) -> Histogram:
    """A histogram of durations in seconds over ``buckets``."""
    return meter().create_histogram(
        name, unit="s", description=description, explicit_bucket_boundaries_advisory=buckets
    )


# ---------------------------------------------------------------- stage, dead-letter and weight-sync metrics


class _Instruments:
    """The instruments every service may use, made once per process."""

    def __init__(self) -> None:
        m = meter()
        self.groups = counter("rlpipe_groups_processed", "{group}", "messages a stage settled, by outcome")
        self.latency = seconds_histogram(
            "rlpipe_stage_latency", "from fetch to ack (ok), nak (retry) or term (dead)", LATENCY_BUCKETS_S
        )
        self.lag = m.create_observable_gauge(
            "rlpipe_consumer_lag",
            callbacks=[_observe_lag],
            unit="{message}",
            description="messages not yet delivered by the stage's consumer",
        )
        self.dead_letters = counter("rlpipe_dead_letters", "{message}", "messages copied to DEAD")
        self.breaker = m.create_gauge(
            "rlpipe_stage_breaker_state",
            description="the stage's dependency circuit breaker: 0 closed, 1 half-open, 2 open (fetching paused)",
        )
        self.sync_duration = seconds_histogram(
            "rlpipe_weight_sync_duration", "pull and load of one policy version", SLOW_BUCKETS_S
        )
        self.sync_bytes = counter("rlpipe_weight_sync_bytes", "By", "weight bytes pulled from the trainer")
        self.policy_version = m.create_gauge(
            "rlpipe_rollout_policy_version", description="policy version loaded in the engine"
        )
        self.stalled = m.create_observable_gauge(
            "rlpipe_stage_stalled",
            callbacks=[_observe_stalled],
            description="1 while the stage's loop has made no progress for 2 * nats.max_work_s, else 0",
        )
        self.starts = m.create_gauge(
            "rlpipe_service_starts", description="starts of this replica's instance name, restarts included"
        )
        self.stage_time = m.create_observable_counter(
            "rlpipe_stage_time",
            callbacks=[_observe_stage_time],
            unit="s",
            description="the stage loop's wall time by activity: busy (computing), idle (waiting for input), "
            "blocked (publishing, waiting for weights or a dependency)",
        )


@functools.cache
def _instruments() -> _Instruments:
    return _Instruments()


# (role, edge) -> the consumer's pending count at the stage's latest fetch. Written on the event loop,
# read by the scrape thread's callback, which must never do NATS I/O itself.
_consumer_lag: dict[tuple[str, str], int] = {}


def _observe_lag(options: CallbackOptions) -> Iterable[Observation]:
    return [Observation(pending, {"role": role, "edge": edge}) for (role, edge), pending in list(_consumer_lag.items())]


# (role, edge) -> seconds the stage has been stuck beyond its bound at a given wall time (Stage.stalled_for).
_stall_clocks: dict[tuple[str, str], Callable[[float], float]] = {}


def _observe_stalled(options: CallbackOptions) -> Iterable[Observation]:
    now = time.time()
    return [
        Observation(int(stalled_for(now) > 0), {"role": role, "edge": edge})
        for (role, edge), stalled_for in list(_stall_clocks.items())
    ]


# (role, edge) -> seconds per activity so far (Stage.time_share.seconds), read at each scrape.
_stage_times: dict[tuple[str, str], Callable[[], Mapping[StageActivity, float]]] = {}


def _observe_stage_time(options: CallbackOptions) -> Iterable[Observation]:
    return [
        Observation(seconds, {"role": role, "edge": edge, "activity": str(activity)})
        for (role, edge), spent in list(_stage_times.items())
        for activity, seconds in spent().items()
    ]


class StageMetrics:
    """What one stage (``role`` consuming ``edge``) records."""

    def __init__(self, role: str, edge: str):
        self.instruments = _instruments()
        self.key = (role, edge)
        self.attributes = {"role": role, "edge": edge}
        # Each reason's series from the start at 0: a healthy run's dashboard and increase() show 0 dead letters,
        # not a missing series.
        for reason in DEAD_LETTER_REASONS:
            self.instruments.dead_letters.add(0, {**self.attributes, "reason": reason})

    def lag(self, pending: int) -> None:
        _consumer_lag[self.key] = pending

    def watch_progress(self, stalled_for: Callable[[float], float]) -> None:
        """Export ``rlpipe_stage_stalled`` from ``stalled_for(now)``, asked at each scrape."""
        _stall_clocks[self.key] = stalled_for

    def watch_time(self, spent: Callable[[], Mapping[StageActivity, float]]) -> None:
        """Export ``rlpipe_stage_time_seconds_total{activity}`` from ``spent()``, asked at each scrape."""
        _stage_times[self.key] = spent

    def breaker(self, state: int) -> None:
        self.instruments.breaker.set(int(state), self.attributes)

    def settled(self, outcome: str, seconds: float) -> None:
        attributes = {**self.attributes, "outcome": outcome}
        self.instruments.groups.add(1, attributes)
        self.instruments.latency.record(seconds, attributes)


def record_dead_letter(role: str, edge: str, reason: str) -> None:
    _instruments().dead_letters.add(1, {"role": role, "edge": edge, "reason": reason})


def record_service_starts(role: str, starts: int) -> None:
    _instruments().starts.set(starts, {"role": role})


def record_weight_sync(seconds: float, nbytes: int, version: int) -> None:
    instruments = _instruments()
    instruments.sync_duration.record(seconds)
    instruments.sync_bytes.add(nbytes)
    instruments.policy_version.set(version)


# ---------------------------------------------------------------- the trainer


class TrainerMetrics:
    """The trainer's step, checkpoint and alert metrics; every call only updates in-memory aggregates."""

    def __init__(self) -> None:
        m = meter()
        # No unit given: the exporter would append it to the name, and the names are the dashboards' and alerts'.
        self.gauges = {
            metric.key: m.create_gauge(metric.gauge_name, description=metric.description) for metric in EXPORTED
        }
        self.nonfinite = counter(
            "rlpipe_trainer_nonfinite_metrics", "{value}", "step values not exported because they were NaN or infinite"
        )
        self.checkpoint_duration = seconds_histogram(
            "rlpipe_checkpoint_duration", "time to store one checkpoint", SLOW_BUCKETS_S
        )
        self.checkpoint_stall = seconds_histogram(
            "rlpipe_checkpoint_stall", "time a checkpoint's snapshot held the training loop", LATENCY_BUCKETS_S
        )
        self.checkpoints = counter(
            "rlpipe_checkpoints",
            "{checkpoint}",
            "checkpoints stored or failed",
            present=[{"outcome": outcome} for outcome in ("ok", "failed")],
        )
        self.alerts = counter("rlpipe_alerts_fired", "{alert}", "alert rules that fired")
        self.groups = counter(
            "rlpipe_trainer_groups",
            "{group}",
            "fed groups dead-lettered, lost, or refused as repeats",
            present=[{"fate": fate} for fate in GROUP_FATES],
        )

    def record_step(self, row: Mapping[str, Any]) -> None:
        """Set ``rlpipe_trainer_<key>`` for each exported key (``EXPORTED``) in ``row``; others are ignored.

        A NaN or infinite value leaves its gauge unchanged and counts in
        ``rlpipe_trainer_nonfinite_metrics_total{metric}`` (the step row and alerts still see it).
        """
        for key, gauge in self.gauges.items():
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars are Real too
                continue
            if math.isfinite(value):
                gauge.set(float(value))
            else:
                self.nonfinite.add(1, {"metric": key})

    def record_checkpoint(self, seconds: float, ok: bool) -> None:
        outcome = "ok" if ok else "failed"
        self.checkpoint_duration.record(seconds, {"outcome": outcome})
        self.checkpoints.add(1, {"outcome": outcome})

    def record_checkpoint_stall(self, seconds: float) -> None:
        self.checkpoint_stall.record(seconds)

    def record_groups(self, fate: str, count: int) -> None:
        self.groups.add(count, {"fate": fate})

    def record_alert(self, rule: str, severity: str) -> None:
        self.alerts.add(1, {"rule": rule, "severity": severity})


# ---------------------------------------------------------------- free disk space


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on the filesystem holding ``path`` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return shutil.disk_usage(".").free


class DiskWatch:
    """Free space of the directories a save writes to, against what one save needs.

    ``needed_bytes`` is the newest checkpoint's size (``saw_checkpoint``), at least ``min_free_bytes``. The
    gauges are read at each scrape (one statvfs per path); ``free_saves`` gives the same figure to the alert rules.
    """

    def __init__(self, paths: list[Path], min_free_bytes: int):
        self.paths = list(dict.fromkeys(path.resolve() for path in paths))
        self.min_free_bytes = min_free_bytes
        self.checkpoint_bytes = 0
        m = meter()
        m.create_observable_gauge(
            "rlpipe_disk_free", callbacks=[self._observe_free], unit="By", description="free space where saves go"
        )
        m.create_observable_gauge(
            "rlpipe_disk_free_saves",
            callbacks=[self._observe_saves],
            description="free space over what one save needs",
        )

    @property
    def needed_bytes(self) -> int:
        return max(self.checkpoint_bytes, self.min_free_bytes, 1)

    def saw_checkpoint(self, nbytes: int) -> None:
        self.checkpoint_bytes = nbytes

    def free_saves(self) -> float:
        """How many saves the fullest of the paths still has room for."""
        return min(free_bytes(path) for path in self.paths) / self.needed_bytes

    def _observe_free(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(free_bytes(path), {"path": str(path)}) for path in self.paths]

    def _observe_saves(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(free_bytes(path) / self.needed_bytes, {"path": str(path)}) for path in self.paths]


def watch_gpus(role: str) -> GpuWatch | None:
    """Export the GPUs of this process as ``rlpipe_gpu_*{role,gpu,uuid}``, read from NVML at each scrape.

    Without NVML, a driver or a GPU nothing is exported and None is returned. Reading at the scrape, not on the
    role's loop, keeps the loop free of NVML and the samples as frequent as the scrapes (a rollout's or
    reference's loop has no step to sample at, unlike the trainer's).
    """
    watch = GpuWatch.open()
    if watch is None:
        return None
    gauges = (
        ("rlpipe_gpu_utilization", "%", "% of NVML's last sample period a kernel ran on the GPU", "util_pct"),
        ("rlpipe_gpu_memory_used", "By", "GPU memory in use, all processes on the device", "mem_used_bytes"),
        ("rlpipe_gpu_memory_total", "By", "GPU memory of the device", "mem_total_bytes"),
    )
    for name, unit, description, field in gauges:
        meter().create_observable_gauge(
            name, callbacks=[_gpu_callback(watch, role, field)], unit=unit, description=description
        )
    return watch


def watch_gpu_memory(role: str, read: Callable[[], ProcessGpuMemory] | None = None) -> None:
    """Export this process's GPU memory as ``rlpipe_role_gpu_memory_bytes{role,kind}``, ``read()`` at each scrape
    (default: ``process_gpu_memory`` of this process); a figure it does not have is no series."""
    reading = read or (lambda: process_gpu_memory(os.getpid()))

    def observe(options: CallbackOptions) -> Iterable[Observation]:
        memory = reading()
        figures = {"allocated": memory.allocated, "reserved": memory.reserved, "used": memory.used}
        return [
            Observation(value, {"role": role, "kind": kind}) for kind, value in figures.items() if value is not None
        ]

    meter().create_observable_gauge(
        "rlpipe_role_gpu_memory",
        callbacks=[observe],
        unit="By",
        description="GPU memory this process holds: allocated and reserved by torch, used as NVML counts it",
    )


def _gpu_callback(watch: GpuWatch, role: str, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(getattr(reading, field), {"role": role, "gpu": str(reading.index), "uuid": reading.uuid})
            for reading in watch.read()
        ]

    return observe
