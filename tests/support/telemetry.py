"""What a test reads telemetry with: an OTLP collector in the test's process, Prometheus scrapes and their samples,
and a run config for a process that starts telemetry without a model."""

from __future__ import annotations

import math
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict
    error: bool


def _value(value: AnyValue):
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


class OtlpReceiver:
    """An OTLP/gRPC collector in the test: keeps every span and the names of every metric it is sent."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.metric_names: set[str] = set()
        self.lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None)

    def by_name(self, name: str) -> list[ReceivedSpan]:
        with self.lock:
            return [span for span in self.spans if span.name == name]


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver):
        self.receiver = receiver

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=resource.get("service.name", ""),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            error=span.status.code == Status.STATUS_CODE_ERROR,
                        )
                    )
        with self.receiver.lock:
            self.receiver.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpReceiver):
        self.receiver = receiver

    def Export(self, request, context):
        names = {m.name for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        with self.receiver.lock:
            self.receiver.metric_names |= names
        return metrics_service_pb2.ExportMetricsServiceResponse()


def scrape(url: str) -> list[Sample]:
    """Every sample of a Prometheus scrape of ``url``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def values(samples: list[Sample], name: str, **labels: str) -> list[float]:
    """Values of the samples called ``name`` whose labels include ``labels``."""
    return [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def one_value(samples: list[Sample], name: str, **labels: str) -> float:
    found = values(samples, name, **labels)
    assert len(found) == 1, (name, labels, found)
    assert math.isfinite(found[0]), (name, labels, found)
    return found[0]


def minimal_config(tmp_path: Path, **sections: dict) -> Path:
    """A valid run config; telemetry needs no real model or data, only files that exist."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    config = {
        "run_id": "tele",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.jsonl")},
        "nats": {"ack_wait_s": 30, "max_deliver": 3, "duplicate_window_s": 600, "fetch_timeout_s": 0.5},
        **sections,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
