"""What the launcher knows of its run, read where any other tool of the run reads it, never from its children's
log lines (whose format is theirs to change):

- ``PresenceWatch``: each replica's presence entry, the one ``rlpipe status`` shows. A replica is ready when its
  entry carries its start-up report (``ServiceEntry.startup``, written by ``services.common.service.announce_ready``)
  and was written by the process the launcher started (its pid, or a descendant's for a torchrun trainer).
- ``PresenceWatch.scale_records``: the replica counts operators asked for (``rlpipe scale``), which the trainer
  stores in the run's config bucket (services/common/transport/scale.py), read with the presence entries.
- ``RunRecord``: the trainer's steps and evaluations in the metrics file, and what happened to the run (operators'
  actions, alerts, ``done``) in ``events.jsonl``, both followed from the launch on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats

from services.common.config import RunConfig
from services.common.observe.events import Event
from services.common.observe.logs import JsonlFollower
from services.common.observe.records import EventRecord, MetricsRow, RunDone, event_records, metrics_rows
from services.common.observe.usage import with_descendants
from services.common.transport import live_config
from services.common.transport.nats_connect import connect_options
from services.common.transport.presence import SeenService, bucket_name, presence_key, read_presence
from services.common.transport.scale import ScaleRecord, read_scale

log = logging.getLogger(__name__)
POLL_S = 0.5  # how often the presence bucket is read: a replica's readiness reaches run.json within this
CONNECT_ATTEMPTS = 10  # tries of a connection (and of each reconnect) before it is made anew at the next poll


class PresenceWatch:
    """The run's presence entries, read every ``POLL_S`` on a thread of its own (with the operator's NATS key) for
    as long as the run lasts; a broker restart only delays the next reading."""

    def __init__(self, cfg: RunConfig, nats_url: str, seed_file: Path):
        self.cfg = cfg
        self.nats_url = nats_url
        self.nats = cfg.nats.model_copy(update={"nkey_seed_file": seed_file})
        self.last_error = ""  # why the last reading failed; empty once one succeeds (said when a start times out)
        self._entries: dict[str, SeenService] = {}  # by presence key: an instance name is unique within its role
        self._scale: dict[str, ScaleRecord] = {}
        self._readings = 0  # completed readings so far
        self._read = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._watch(),), name="presence-watch", daemon=True)

    def start(self) -> PresenceWatch:
        self._thread.start()
        return self

    def entry(self, role: str, instance: str) -> SeenService | None:
        with self._read:
            return self._entries.get(presence_key(role, instance))

    def scale_records(self) -> dict[str, ScaleRecord]:
        """role -> the newest replica count asked for, as last read; roles never scaled are absent."""
        with self._read:
            return dict(self._scale)

    def ready_entry(self, role: str, instance: str, pid: int, since: float) -> SeenService | None:
        """The entry of ``role``'s ``instance`` if the process ``pid`` (or one it started) wrote it at or after
        ``since`` (wall time) and it carries its start-up report: the entry of a predecessor that died is never
        taken."""
        entry = self.entry(role, instance)
        if entry is None or not entry.startup or entry.stopped or entry.time < since:
            return None
        return entry if entry.pid in with_descendants(pid) else None

    def await_reading(self, timeout_s: float) -> bool:
        """Wait for a reading that starts after this call (what a process wrote before it exited is in it);
        False when none came within ``timeout_s``."""
        with self._read:
            wanted = self._readings + 2  # the one under way may have begun before the call
            return self._read.wait_for(lambda: self._readings >= wanted, timeout=timeout_s)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)

    async def _watch(self) -> None:
        client = None
        try:
            while not self._closed.is_set():
                try:
                    if client is None or client.is_closed:
                        client = await nats.connect(
                            self.nats_url,
                            **connect_options(self.nats, "operator"),
                            # Bounded, so that a close is heeded: a client given up on is made again.
                            max_reconnect_attempts=CONNECT_ATTEMPTS,
                            error_cb=_unheard,  # a broker restart is the launcher's to report, not the client's
                        )
                    js = client.jetstream()
                    await js.key_value(bucket_name(self.cfg.run_id))  # only the trainer creates it: until then, wait
                    entries = await read_presence(js, self.cfg.run_id, self.cfg.nats)
                except Exception as error:  # no bucket yet, or the broker away: read again at the next poll
                    self.last_error = repr(error)[:300]
                    log.debug("presence not read: %r", error)
                else:
                    with self._read:
                        self._entries = {presence_key(entry.role, entry.instance): entry for entry in entries}
                        self.last_error = ""
                    await self._read_scale(js)
                with self._read:
                    self._readings += 1
                    self._read.notify_all()
                await asyncio.sleep(POLL_S)
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()

    async def _read_scale(self, js: Any) -> None:
        """The replica counts asked for; on a failure those read before stand until the next poll."""
        try:
            scale = await read_scale(await js.key_value(live_config.bucket_name(self.cfg.run_id)))
        except Exception as error:  # the broker away: the counts change only when an operator asks anyway
            log.debug("scale requests not read: %r", error)
            return
        with self._read:
            self._scale = scale


async def _unheard(error: Exception) -> None:
    log.debug("presence watch: %r", error)


@dataclass
class RunRecord:
    """The rows the trainer appends to the metrics file and the run's ``events.jsonl``, from the launch on (a
    resumed run's earlier rows are not news)."""

    metrics: JsonlFollower
    events: JsonlFollower
    done: RunDone | None = None  # the ``done`` event, once it is written

    @classmethod
    def of_run(cls, cfg: RunConfig) -> RunRecord:
        return cls(
            JsonlFollower(cfg.metrics_file).skip_to_end(), JsonlFollower(cfg.run_dir / "events.jsonl").skip_to_end()
        )

    def new_steps(self) -> tuple[list[MetricsRow], list[MetricsRow]]:
        """The new training-step rows and evaluation rows of the metrics file."""
        rows = metrics_rows(self.metrics.new_rows())
        return [row for row in rows if row.is_step], [row for row in rows if row.is_eval]

    def new_events(self) -> list[EventRecord]:
        """The new rows of ``events.jsonl``; a ``done`` row is also kept in ``done``."""
        events = event_records(self.events.new_rows())
        for event in events:
            if event.kind == Event.DONE:
                self.done = RunDone.of(event)
        return events
