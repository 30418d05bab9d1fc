"""Structured JSON logs: one object per line with time, level, service, run id and event.

Fields bound with ``bind_log_fields`` (the replica's instance, the trainer's current
step) ride on every later line, and a line logged inside a span carries its trace and
span ids, so logs and traces can be joined.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from opentelemetry import trace

# Fields on every line from now on; written between steps, read by every log call.
_bound: dict[str, Any] = {}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, run_id: str):
        super().__init__()
        self.base = {"service": service, "run_id": run_id}

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            **self.base,
            **_bound,
            "event": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            payload["trace_id"] = trace.format_trace_id(span.trace_id)
            payload["span_id"] = trace.format_span_id(span.span_id)
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def setup_logging(service: str, run_id: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service, run_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Third-party chatter (vLLM, transformers, nats) stays out of our event stream unless it matters.
    for noisy in ("vllm", "transformers", "nats", "urllib3", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def bind_log_fields(**fields: Any) -> None:
    """Add ``fields`` to every later line of this process (``bind_log_fields(step=12)``); a None value removes one."""
    for key, value in fields.items():
        if value is None:
            _bound.pop(key, None)
        else:
            _bound[key] = value


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    logger.log(level, event, extra={"fields": fields})


class Stopwatch:
    """Seconds since creation, rounded for logs."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.start, 3)
