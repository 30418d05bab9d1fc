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
API's proxies: they cost next to nothing and bind once a provider is set. The instruments each role records,
and the series a scrape shows, are in instruments.py.

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
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from opentelemetry import metrics, propagate, trace
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
from services.common.observe.usage import process_cpu_seconds

SCOPE = "rlpipe"
# An unreachable collector must not hold up a stopping service for long (the launcher kills after 20 s).
EXPORT_TIMEOUT_S = 5.0


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
            # Imported only here: the exporters and their protobuf messages cost every process start that exports
            # nothing (most runs) about 0.07 CPU seconds.
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

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
