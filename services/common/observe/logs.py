"""Structured JSON logs: one object per line with time, level, service, run id and event.

Fields bound with ``bind_log_fields`` (the replica's instance, the trainer's current
step) ride on every later line, and a line logged inside a span carries its trace and
span ids, so logs and traces can be joined.

``RotatingLog`` keeps a service's log file (written by ``rlpipe run``) within a size: past
``max_bytes`` it becomes ``<name>.1`` (the one before ``<name>.2``, and so on) and only ``keep``
of those stay, so a week-long run cannot fill its disk with logs. In containers the runtime
rotates stderr instead (compose's logging options, the kubelet's containerLogMaxSize).

``RollingJsonl`` does the same for a run's record (``metrics.jsonl``, ``events.jsonl``): past
its size the file becomes ``metrics.00001.jsonl`` (then ``.00002``...), never renamed again, and
a fresh ``metrics.jsonl`` goes on. With ``keep_parts`` only the newest that many rolled parts stay
(the oldest is deleted at each roll past it, so the numbers of those left go on from where they
were); without it every part is kept. Several processes may write one
record (the launcher and the trainer both write ``events.jsonl``): each line is appended under
an exclusive lock on ``.<name>.lock`` beside it, so no two writers roll at once or write into a
part after it was rolled. ``jsonl_parts`` lists the parts in order for readers of the whole
record; ``JsonlFollower`` follows the record across rolls.
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from opentelemetry import trace

from services.common.config.redaction import hide_url_secrets

if TYPE_CHECKING:  # events.py builds its journal on log_event
    from services.common.observe.events import Event

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
        # A URL's credentials never reach a log, wherever they came from (a field, an exception's text).
        return hide_url_secrets(json.dumps(payload, default=str))


class RotatingLogHandler(logging.Handler):
    """Log records as lines of a ``RotatingLog``: a service's own log file beside its stderr (``service.log_dir``)."""

    def __init__(self, log: RotatingLog):
        super().__init__()
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.write((self.format(record) + "\n").encode())
        except Exception:  # a full disk must not stop the service: logging's own report, on stderr
            self.handleError(record)

    def close(self) -> None:
        self.log.close()
        super().close()


def setup_logging(
    service: str, run_id: str, level: str = "INFO", log_file: Path | None = None, max_bytes: int = 0, keep: int = 0
) -> None:
    """JSON lines to stderr, and with ``log_file`` to that file too, rotated past ``max_bytes`` keeping ``keep``."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(RotatingLogHandler(RotatingLog(log_file, max_bytes, keep)))
    for handler in handlers:
        handler.setFormatter(JsonFormatter(service, run_id))
    root = logging.getLogger()
    root.handlers[:] = handlers
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


def log_event(logger: logging.Logger, event: Event, level: int = logging.INFO, **fields: Any) -> None:
    """One JSON log line named by ``event`` (a member of ``Event``, never a free string: the names are a contract).
    The log sink of the journal (``events.Journal``), and the only sink of components without a run record."""
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


def rolled_part(path: Path, number: int) -> Path:
    """The ``number``-th rolled part of a JSON-lines record: ``metrics.jsonl`` -> ``metrics.00001.jsonl``."""
    return path.with_name(f"{path.stem}.{number:05d}{path.suffix}")


def _rolled_parts(path: Path) -> dict[int, Path]:
    """Number -> rolled part of the record ``path`` (``metrics.00012.jsonl`` is 12), in number order."""
    parts = {}
    for part in path.parent.glob(f"{glob.escape(path.stem)}.*{glob.escape(path.suffix)}"):
        middle = part.name.removeprefix(f"{path.stem}.").removesuffix(path.suffix)
        if middle.isdigit() and part.name == rolled_part(path, int(middle)).name:
            parts[int(middle)] = part
    return dict(sorted(parts.items()))


def jsonl_parts(path: Path) -> list[Path]:
    """The parts of the record ``path`` in the order they were written: rolled parts, then ``path`` itself.
    The oldest parts may have been pruned (``RollingJsonl``'s ``keep_parts``): the first one left comes first."""
    return list(_rolled_parts(path).values()) + ([path] if path.is_file() else [])


class RollingJsonl:
    """Appends JSON lines to ``path``, rolling it to its next numbered part past ``max_bytes``; safe for several
    writing processes (see the module docstring)."""

    def __init__(self, path: Path, max_bytes: int, keep_parts: int = 0):
        """``keep_parts``: the newest rolled parts kept, older ones deleted as the record rolls; 0 keeps all."""
        if max_bytes < 1 or keep_parts < 0:
            raise ValueError("max_bytes must be >= 1 and keep_parts >= 0")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        self.keep_parts = keep_parts
        self.lock_path = path.with_name(f".{path.name}.lock")

    def write(self, line: str) -> None:
        """Append one line (with its newline) whole; see ``write_lines``."""
        self.write_lines([line])

    def write_lines(self, lines: list[str]) -> None:
        """Append whole lines (each with its newline) under one lock, the file opened per part so a reader never
        sees a half-rolled file.

        Under the lock the size is read, the file rolled and each line written as one step: another writer's
        roll can neither reuse a part number (the next one is counted on disk, not remembered) nor leave a
        line in a part a follower has already read to its end."""
        with self.lock_path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            size = self.path.stat().st_size if self.path.exists() else 0
            pending = b""
            for line in lines:
                data = line.encode()
                if (size or pending) and size + len(pending) + len(data) > self.max_bytes:
                    self._append(pending)
                    self._roll()
                    size, pending = 0, b""
                pending += data
            self._append(pending)

    def _roll(self) -> None:
        """The file becomes the part after the newest (counted on disk), then the oldest parts past
        ``keep_parts`` go. Called under the lock."""
        rolled = _rolled_parts(self.path)
        self.path.replace(rolled_part(self.path, max(rolled, default=0) + 1))
        if self.keep_parts:
            for old in list(rolled.values())[: max(len(rolled) + 1 - self.keep_parts, 0)]:
                old.unlink(missing_ok=True)

    def _append(self, data: bytes) -> None:
        if data:
            with self.path.open("ab") as out:
                out.write(data)


class JsonlFollower:
    """The new complete lines of a file another process appends to, like ``tail -F``: the rolled parts that exist
    at its first read first (``jsonl_parts``), then the file itself; when the file is renamed away (rolled or rotated)
    and a new one takes its name, the old one is read to its end before the new one, and so are the parts rolled
    after it, also those rolled while it was opening the new one (another process may roll at any moment).
    A rotated log (``RotatingLog``, whose files shift names) must not rotate twice between two calls.
    A half-written last line waits for its end."""

    def __init__(self, path: Path):
        self.path = path
        self._queued: list[Path] | None = None  # listed at the first read: the record may not exist yet
        self._file: IO[bytes] | None = None
        self._pending = b""
        self._finished: int | None = None  # inode of the last file read to its end: the next part follows it

    def skip_to_end(self) -> JsonlFollower:
        """Follow only what is written from now on: the parts and lines there already are not read."""
        parts = jsonl_parts(self.path)
        if parts:  # else nothing was written yet: the first read lists the parts made since
            self._queued = []
            self._file = parts[-1].open("rb")  # a rolled part only in the moment before its successor exists
            self._file.seek(0, os.SEEK_END)
        return self

    def new_lines(self) -> list[bytes]:
        lines: list[bytes] = []
        while True:
            file = self._file if self._file is not None else self._open_next()
            if file is None:
                return lines
            lines += self._read(file)
            if self._queued or self._renamed_away(file):
                lines += self._read(file)  # what was written before the rename
                self._finished = os.fstat(file.fileno()).st_ino
                file.close()
                self._file, self._pending = None, b""
                continue
            return lines

    def _parts_after(self, inode: int | None) -> list[Path]:
        """The rolled parts after the one that is ``inode``; all of them for None (no file read yet)."""
        rolled = [part for part in jsonl_parts(self.path) if part != self.path]
        if inode is None:
            return rolled
        inodes = [part.stat().st_ino for part in rolled]
        if inode in inodes:
            return rolled[inodes.index(inode) + 1 :]
        # Not a rolled part: a rotated log's file (its record has no parts), or a part pruned since it was read,
        # which goes oldest first, so every part left is newer than it.
        return rolled

    def new_rows(self) -> list[dict[str, Any]]:
        """``new_lines`` that are JSON objects (a torn line from a killed writer is skipped)."""
        rows = []
        for line in self.new_lines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def _open_next(self) -> IO[bytes] | None:
        """The next file to read (it becomes ``_file``), None while there is none."""
        first = self._queued is None
        if first:
            self._queued = [part for part in jsonl_parts(self.path) if part != self.path]
        if self._queued:
            self._file = self._queued.pop(0).open("rb")  # a rolled part keeps its name
            return self._file
        try:
            current = self.path.open("rb")
        except FileNotFoundError:
            if first:
                self._queued = None  # nothing yet: list the parts again at the next call
            return None
        # Parts rolled since the queue was listed (the file just opened among them, if it rolled meanwhile) come
        # first; none means the file opened is the one that follows the last file read.
        self._queued = self._parts_after(self._finished)
        if self._queued:
            current.close()
            current = self._queued.pop(0).open("rb")
        self._file = current
        return current

    def _read(self, file: IO[bytes]) -> list[bytes]:
        data = self._pending + file.read()
        end = data.rfind(b"\n") + 1
        self._pending = data[end:]
        return data[:end].splitlines()

    def _renamed_away(self, file: IO[bytes]) -> bool:
        try:
            return os.stat(self.path).st_ino != os.fstat(file.fileno()).st_ino
        except FileNotFoundError:  # renamed, its successor not made yet: read on in the old one
            return False
