"""A bounded background writer: the training loop hands rows over and goes on; one thread writes them in batches.

The metrics file and the experiment trackers (TensorBoard, MLflow, W&B) are written from here, so a slow disk,
a tracking server that hangs or a W&B sync never adds to a step's time. ``put`` never waits: with ``capacity``
rows already queued the row is dropped and counted (``dropped``, and ``rlpipe_metrics_dropped_total{writer}`` on
the Prometheus endpoint) — a dashboard that cannot keep up loses rows, the run does not stall for it.

Rows reach the sink in the order they were put. ``flush`` waits until everything put so far was handed over;
``close`` flushes and ends the thread. A drained service exits with ``os._exit`` (services/common/service.py),
which would lose what is still queued: it calls ``close_all`` first, which closes every writer still open.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from opentelemetry.metrics import Counter

from services.common.observe.events import Event
from services.common.observe.instruments import counter
from services.common.observe.logs import log_event

log = logging.getLogger(__name__)

Row = TypeVar("Row")
# Rows a writer holds before it drops: minutes of steps even at several rows a second, a few MiB of memory.
CAPACITY_ROWS = 4096
# Rows handed to the sink at once: a backlog after a stall is written in a few calls, not one per row.
BATCH_ROWS = 256

_open: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()


@functools.cache
def _dropped_counter() -> Counter:
    return counter("rlpipe_metrics_dropped", "{row}", "metrics rows dropped because the writer's queue was full")


class BackgroundWriter(Generic[Row]):
    """Rows to ``sink`` (which takes a batch) on a thread named ``name``; at most ``capacity`` rows wait."""

    def __init__(self, name: str, sink: Callable[[list[Row]], None], capacity: int = CAPACITY_ROWS):
        self.name = name
        self.sink = sink
        self.dropped = 0
        self.failing = False  # the sink's last batch raised; logged once until a batch goes through
        self._queue: queue.Queue[Row | None] = queue.Queue(maxsize=capacity)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"writer-{name}", daemon=True)
        self._thread.start()
        _open.add(self)

    def put(self, row: Row) -> bool:
        """Queue ``row`` without waiting; False (and counted as dropped) when the queue is full or closed."""
        if self._closed:
            return self._drop()
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            return self._drop()
        return True

    def flush(self) -> None:
        """Wait until every row put so far was handed to the sink."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then end the thread; later rows are dropped."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)  # may wait for room: the sink is draining, and nothing may be lost here
        self._thread.join()
        _open.discard(self)

    def _drop(self) -> bool:
        self.dropped += 1
        _dropped_counter().add(1, {"writer": self.name})
        return False

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < BATCH_ROWS:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            rows = [row for row in batch if row is not None]
            try:
                if rows:
                    self.sink(rows)
                self.failing = False
            except Exception as error:  # a full disk must not end the thread: later rows may still be written
                if not self.failing:
                    log_event(log, Event.WRITER_FAILED, level=logging.ERROR, writer=self.name, error=repr(error)[:300])
                self.failing = True
            finally:
                for _ in batch:
                    self._queue.task_done()
            if len(rows) < len(batch):
                return


def close_all() -> None:
    """Close every writer still open (its rows written): before a process ends without its finalizers."""
    for writer in list(_open):
        writer.close()
