"""Structured JSON logs: one object per line with time, level, service, run id and event.

Fields bound with ``bind_log_fields`` (the replica's instance, the trainer's current
step) ride on every later line, and a line logged inside a span carries its trace and
span ids, so logs and traces can be joined.

``RotatingLog`` keeps a service's log file (written by ``rlpipe run``) within a size: past
``max_bytes`` it becomes ``<name>.1`` (the one before ``<name>.2``, and so on) and only ``keep``
of those stay, so a week-long run cannot fill its disk with logs. In containers the runtime
rotates stderr instead (compose's logging options, the kubelet's containerLogMaxSize).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import IO, Any

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


class RotatingLog:
    """A log file of whole lines that rotates by size: ``write`` appends a line, ``close`` ends it."""

    def __init__(self, path: Path, max_bytes: int, keep: int):
        if max_bytes < 1 or keep < 0:
            raise ValueError("max_bytes must be >= 1 and keep >= 0")
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._file: IO[bytes] = path.open("ab")
        self._size = self._file.tell()

    def write(self, line: bytes) -> None:
        """Append ``line`` (flushed, for readers that follow the file); a line never straddles two files."""
        if self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._file.flush()
        self._size += len(line)

    def close(self) -> None:
        self._file.close()

    def rotated(self) -> list[Path]:
        """The rotated files that exist, oldest first."""
        return [path for n in range(self.keep, 0, -1) if (path := self._numbered(n)).exists()]

    def _numbered(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    def _rotate(self) -> None:
        self._file.close()
        if self.keep:
            for n in range(self.keep - 1, 0, -1):  # each moves up by one, over the oldest (.keep), which drops off
                if self._numbered(n).exists():
                    self._numbered(n).replace(self._numbered(n + 1))
            self.path.replace(self._numbered(1))
        else:
            self.path.unlink()
        self._file = self.path.open("ab")
        self._size = 0
