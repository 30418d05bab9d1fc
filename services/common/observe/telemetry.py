"""OpenTelemetry for every service: metrics on a Prometheus endpoint (plus OTLP), traces across the bus.

``start_telemetry`` sets the process-wide meter and tracer providers once, serves
``/metrics`` on ``service.host:telemetry.metrics_port`` (0 = a free port, see
``Telemetry.metrics_url``) and, when ``telemetry.otlp_endpoint`` is set, exports
metrics and spans there over OTLP/gRPC. Without an endpoint spans are still
created, so trace context still travels from service to service.

Recording is in-memory only (an aggregation under a short per-metric lock); scrapes run on
the HTTP server's thread and OTLP exports on the SDK's own threads, so nothing
here waits on the network from the caller's thread or event loop. Instruments
made before ``start_telemetry`` (or in a process that never calls it) are the
API's proxies: they cost next to nothing and bind once a provider is set.

Names as a Prometheus scrape shows them (the exporter appends the unit and, for
counters, ``_total``; histograms come as ``_bucket``/``_sum``/``_count``):

every service
  rlpipe_process_resident_memory_bytes                    gauge, resident set size
  rlpipe_process_cpu_seconds_total                        counter, CPU time used (core-hours per role, summed)
  rlpipe_log_records_total{level}                         log lines at warning, error or critical: the log error rate
  target_info                                             service.name rlpipe-<role>, service.instance.id, rlpipe.run_id
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
trainer (``TrainerMetrics``)
  rlpipe_trainer_<key>                                    gauge per key of ``TRAINER_STEP_KEYS``
                                                          (rlpipe_trainer_entropy, ...); a "/" in a key
                                                          becomes "_" (``trainer_gauge_name``):
                                                          memory/peak_gb -> rlpipe_trainer_memory_peak_gb
  rlpipe_trainer_nonfinite_metrics_total{metric}          step values left out because they were NaN or infinite
  rlpipe_checkpoint_duration_seconds{outcome}             histogram, outcome: ok | failed
  rlpipe_checkpoints_total{outcome}
  rlpipe_alerts_fired_total{rule,severity}
  rlpipe_trainer_groups_total{fate}                       fed groups settled: fate dead | lost | repeat (refused)
  rlpipe_disk_free_bytes{path}                            gauge, free space of the runs directory and a file:// store
  rlpipe_disk_free_saves{path}                            gauge, that free space over what one save needs (the newest
                                                          checkpoint's size, at least checkpoint.min_free_mib); an
                                                          s3:// store reports no free space, so it has no series

Every sample also carries the exporter's ``otel_scope_*`` labels.

Spans: each stage opens ``<role>.<edge>`` (``rollout.prompts``, ``reward.rollouts``,
``reference.scored``) per message, as a child of the W3C ``traceparent`` in the
message's NATS headers; ``Bus.publish`` writes the current context into the headers
of what it sends on, so one group's spans form one trace, which the trainer closes
with ``trainer.experience`` when it reads the group. Custom span attributes are
namespaced ``rlpipe.`` (``rlpipe.group_id``, ``rlpipe.outcome``, ``rlpipe.delivery``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math
import numbers
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind
from prometheus_client import CollectorRegistry, start_http_server

from services.common.config import RunConfig
from services.common.observe.hardware import HARDWARE_ROW_KEYS
from services.common.observe.usage import process_cpu_seconds

SCOPE = "rlpipe"
# An unreachable collector must not hold up a stopping service for long (the launcher kills after 20 s).
EXPORT_TIMEOUT_S = 5.0

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SLOW_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

# The step-row keys the trainer exports, one gauge each; a fixed list keeps the scrape's size bounded.
GROUP_FATES = ("dead", "lost", "repeat")
TRAINER_STEP_KEYS = (
    "step",
    "policy_version",
    "loss",
    "pg_loss",
    "entropy",
    "kl_ref",
    "approx_kl",
    "clipfrac",
    "clipfrac_lower",
    "value_loss",
    "value_clipfrac",
    "reward_mean",
    "reward_std",
    "advantage_std",
    "zero_variance_groups",
    "response_length_mean",
    "response_length_max",
    "termination_rate",
    "truncation_rate",
    "grad_norm",
    "learning_rate",
    "step_time_s",
    # Where the wall time since the previous step row went (together that whole interval): trainer/service.py.
    "time/wait_s",
    "time/compute_s",
    "time/publish_s",
    "time/eval_s",
    "time/bookkeeping_s",
    "tokens_per_s",
    "staleness_mean",
    "staleness_max",
    "dropped_stale",
    "tis_weight_mean",
    *HARDWARE_ROW_KEYS,  # memory/..., gpu/...: see services/common/observe/hardware.py
)


def trainer_gauge_name(key: str) -> str:
    """The Prometheus name of a step-row key's gauge: ``rlpipe_trainer_`` + the key, each character Prometheus
    does not allow in a name (the ``/`` of ``memory/peak_gb``) as ``_``: ``rlpipe_trainer_memory_peak_gb``."""
    return "rlpipe_trainer_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class Telemetry:
    """The running providers and metrics endpoint of this process."""

    def __init__(
        self,
        role: str,
        instance: str,
        metrics_url: str,
        meter_provider: MeterProvider,
        tracer_provider: TracerProvider,
        server: Any,
    ):
        self.role = role
        self.instance = instance
        self.metrics_url = metrics_url
        self.meter_provider = meter_provider
        self.tracer_provider = tracer_provider
        self._server = server
        self._closed = False
        self._lock = threading.Lock()

    def shutdown(self) -> None:
        """Export what is still queued (spans, a last metrics push), then close the endpoint. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown(timeout_millis=EXPORT_TIMEOUT_S * 1000)
        self._server.shutdown()
        self._server.server_close()


_started: Telemetry | None = None
_start_lock = threading.Lock()


def start_telemetry(cfg: RunConfig, role: str, instance: str) -> Telemetry:
    """Set up metrics and tracing for this process; later calls return the first call's ``Telemetry``.

    The global providers of OpenTelemetry can be set only once per process, hence once here.
    Raises OSError if the metrics port cannot be bound.
    """
    global _started
    with _start_lock:
        if _started is not None:
            return _started
        telemetry_cfg = cfg.telemetry
        resource = Resource.create(
            {
                "service.name": f"rlpipe-{role}",
                "service.instance.id": instance,
                "rlpipe.run_id": cfg.run_id,
                "rlpipe.role": role,
            }
        )
        # Our own registry: the endpoint shows this process's OpenTelemetry metrics and nothing else.
        registry = CollectorRegistry()
        readers: list[MetricReader] = [PrometheusMetricReader(registry=registry)]
        tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        if telemetry_cfg.otlp_endpoint:
            readers.append(
                PeriodicExportingMetricReader(
                    OTLPMetricExporter(endpoint=telemetry_cfg.otlp_endpoint, insecure=True, timeout=EXPORT_TIMEOUT_S),
                    export_interval_millis=telemetry_cfg.export_interval_s * 1000,
                )
            )
            tracer_provider.add_span_processor(
                BatchSpanProcessor(
                    OTLPSpanExporter(endpoint=telemetry_cfg.otlp_endpoint, insecure=True, timeout=EXPORT_TIMEOUT_S)
                )
            )
        # Bound before anything global is set, so a taken port fails the start cleanly.
        server, _ = start_http_server(telemetry_cfg.metrics_port, addr=cfg.service.host, registry=registry)
        meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
        metrics.set_meter_provider(meter_provider)
        trace.set_tracer_provider(tracer_provider)
        meter().create_observable_gauge(
            "rlpipe_process_resident_memory",
            callbacks=[_resident_memory],
            unit="By",
            description="resident set size of this process",
        )
        meter().create_observable_counter(
            "rlpipe_process_cpu_seconds",
            callbacks=[_cpu_seconds],
            unit="s",
            description="CPU time (user + system) this process has used: core-hours per role, where no launcher counts",
        )
        logging.getLogger().addHandler(_LogCounter())
        url = f"http://{_reachable_host(cfg.service.host)}:{server.server_port}/metrics"
        _started = Telemetry(role, instance, url, meter_provider, tracer_provider, server)
        atexit.register(_started.shutdown)
        return _started


class _LogCounter(logging.Handler):
    """Counts warning-and-worse log records by level, so an error rate can be alerted on like any metric."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records = meter().create_counter("rlpipe_log_records", description="log records at warning level or worse")

    def emit(self, record: logging.LogRecord) -> None:
        self.records.add(1, {"level": record.levelname.lower()})


def current_telemetry() -> Telemetry:
    """The ``Telemetry`` that ``start_telemetry`` set up in this process.

    ``run_service`` sets it up before a service's main.
    """
    if _started is None:
        raise RuntimeError("start_telemetry() has not been called in this process")
    return _started


def _reachable_host(host: str) -> str:
    # A wildcard bind is no address to scrape; name the machine instead.
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _resident_memory(options: CallbackOptions) -> Iterable[Observation]:
    # Runs on the scrape (or export) thread: a single small read of /proc, nothing that can block for long.
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except OSError:  # no procfs (not Linux): report nothing rather than a made-up value
        return []
    return [Observation(pages * _PAGE_BYTES)]


def _cpu_seconds(options: CallbackOptions) -> Iterable[Observation]:
    seconds = process_cpu_seconds(os.getpid())
    return [] if seconds is None else [Observation(seconds)]


def meter() -> metrics.Meter:
    return metrics.get_meter(SCOPE)


def tracer() -> trace.Tracer:
    return trace.get_tracer(SCOPE)


# ---------------------------------------------------------------- trace context in message headers


def inject_trace(headers: dict[str, str]) -> dict[str, str]:
    """Write the current trace context (W3C ``traceparent``, ``tracestate``, baggage) into ``headers``; returns them."""
    propagate.inject(headers)
    return headers


def _attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {f"rlpipe.{key}": value for key, value in attributes.items() if value is not None}


def start_span_from_headers(
    name: str, headers: Mapping[str, str] | None, kind: SpanKind = SpanKind.CONSUMER, **attributes: Any
) -> Span:
    """A started (not current) span, child of the ``traceparent`` in ``headers`` or a new root; the caller ends it.

    For a batch of messages handled together: one span per message, each made current
    only around that message's own publish (``trace.use_span(span, end_on_exit=False)``).
    Keyword attributes are recorded as ``rlpipe.<name>``.
    """
    parent = propagate.extract(dict(headers or {}))
    return tracer().start_span(name, context=parent, kind=kind, attributes=_attributes(attributes))


@contextlib.contextmanager
def span_from_headers(
    name: str, headers: Mapping[str, str] | None, kind: SpanKind = SpanKind.CONSUMER, **attributes: Any
) -> Iterator[Span]:
    """``with span_from_headers("trainer.experience", msg.headers, group_id=...)``: the current span for the block.

    ``headers=None`` starts a new trace (with ``kind=SpanKind.PRODUCER`` around a publish
    that starts a group's journey). An exception leaving the block is recorded on the
    span and marks it as an error.
    """
    span = start_span_from_headers(name, headers, kind, **attributes)
    with trace.use_span(span, end_on_exit=True):
        yield span


# ---------------------------------------------------------------- stage, dead-letter and weight-sync metrics


class _Instruments:
    """The instruments every service may use, made once per process."""

    def __init__(self) -> None:
        m = meter()
        self.groups = m.create_counter(
            "rlpipe_groups_processed", unit="{group}", description="messages a stage settled, by outcome"
        )
        self.latency = m.create_histogram(
            "rlpipe_stage_latency",
            unit="s",
            description="from fetch to ack (ok), nak (retry) or term (dead)",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.lag = m.create_observable_gauge(
            "rlpipe_consumer_lag",
            callbacks=[_observe_lag],
            unit="{message}",
            description="messages not yet delivered by the stage's consumer",
        )
        self.dead_letters = m.create_counter(
            "rlpipe_dead_letters", unit="{message}", description="messages copied to DEAD"
        )
        self.breaker = m.create_gauge(
            "rlpipe_stage_breaker_state",
            description="the stage's dependency circuit breaker: 0 closed, 1 half-open, 2 open (fetching paused)",
        )
        self.sync_duration = m.create_histogram(
            "rlpipe_weight_sync_duration",
            unit="s",
            description="pull and load of one policy version",
            explicit_bucket_boundaries_advisory=SLOW_BUCKETS_S,
        )
        self.sync_bytes = m.create_counter(
            "rlpipe_weight_sync_bytes", unit="By", description="weight bytes pulled from the trainer"
        )
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
_stage_times: dict[tuple[str, str], Callable[[], Mapping[str, float]]] = {}


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

    def lag(self, pending: int) -> None:
        _consumer_lag[self.key] = pending

    def watch_progress(self, stalled_for: Callable[[float], float]) -> None:
        """Export ``rlpipe_stage_stalled`` from ``stalled_for(now)``, asked at each scrape."""
        _stall_clocks[self.key] = stalled_for

    def watch_time(self, spent: Callable[[], Mapping[str, float]]) -> None:
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
        self.gauges = {
            key: m.create_gauge(trainer_gauge_name(key), description=f"step row {key!r} of the latest step")
            for key in TRAINER_STEP_KEYS
        }
        self.nonfinite = m.create_counter(
            "rlpipe_trainer_nonfinite_metrics",
            unit="{value}",
            description="step values not exported because they were NaN or infinite",
        )
        self.checkpoint_duration = m.create_histogram(
            "rlpipe_checkpoint_duration",
            unit="s",
            description="time to store one checkpoint",
            explicit_bucket_boundaries_advisory=SLOW_BUCKETS_S,
        )
        self.checkpoints = m.create_counter(
            "rlpipe_checkpoints", unit="{checkpoint}", description="checkpoints stored or failed"
        )
        self.alerts = m.create_counter("rlpipe_alerts_fired", unit="{alert}", description="alert rules that fired")
        self.groups = m.create_counter(
            "rlpipe_trainer_groups", unit="{group}", description="fed groups dead-lettered, lost, or refused as repeats"
        )
        for fate in GROUP_FATES:  # present from the start, so an increase() over them is 0 rather than absent
            self.groups.add(0, {"fate": fate})
        # Both outcomes exist from the start, so a rate over failures is 0 rather than absent.
        for outcome in ("ok", "failed"):
            self.checkpoints.add(0, {"outcome": outcome})

    def record_step(self, row: Mapping[str, Any]) -> None:
        """Set ``rlpipe_trainer_<key>`` for each key of ``TRAINER_STEP_KEYS`` in ``row``; others are ignored.

        A NaN or infinite value leaves its gauge unchanged and counts in
        ``rlpipe_trainer_nonfinite_metrics_total{metric}`` (the step row and alerts still see it).
        """
        for key, gauge in self.gauges.items():
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars are Real too
                continue
            if math.isfinite(value):
                gauge.set(value)
            else:
                self.nonfinite.add(1, {"metric": key})

    def record_checkpoint(self, seconds: float, ok: bool) -> None:
        outcome = "ok" if ok else "failed"
        self.checkpoint_duration.record(seconds, {"outcome": outcome})
        self.checkpoints.add(1, {"outcome": outcome})

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
