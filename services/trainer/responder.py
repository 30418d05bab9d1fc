"""The alert responder: every metrics row is written, judged by the alert rules, and what fires is carried out.

Actions: notify (one ``Event.ALERT`` in the run's journal: log, events file, and ``AlertSink``'s metrics row,
Prometheus counter and webhook), pause, stop,
and rollback — to the newest stable checkpoint, else the newest one saved before the
rule's window. A rollback is queued to the training loop like an operator's, and nobody
awaits it, so one that fails pauses the run with the reason instead of raising. A rule
that fires again right after rolling back to the same step pauses instead of looping.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.common.config import AlertsConfig
from services.common.observe.events import Event, Journal, JournalEntry
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.logs import RollingJsonl, log_event
from services.common.observe.metrics import UndeclaredKeys
from services.common.observe.trackers import TrackerFanout
from services.common.observe.writer import CAPACITY_ROWS, BackgroundWriter
from services.common.transport.live_config import HoldSource
from services.trainer.alerts import AlertEvaluator, Firing, Heartbeat, post_webhook
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.control import Control
from services.trainer.progress import ConfigSource, Progress

log = logging.getLogger(__name__)

Rollback = Callable[[int | None, str], Awaitable[Any]]


class MetricsLog:
    """``metrics.jsonl``: one JSON row per line, whole for readers that follow it, rolled to numbered parts past
    ``max_bytes`` (``RollingJsonl``); and the same rows to the experiment trackers of ``telemetry.report_to``.

    Both are written by a ``BackgroundWriter``: ``write`` stamps the row and returns at once, so neither a slow
    disk nor a slow tracker adds to a step; rows it cannot queue are dropped and counted (``dropped``)."""

    def __init__(
        self,
        path: Path,
        trackers: TrackerFanout | None = None,
        max_bytes: int | None = None,
        capacity: int = CAPACITY_ROWS,
        keep_parts: int = 0,
    ):
        # Without max_bytes one file grows for ever (a drill's or a test's short record).
        self.file = RollingJsonl(path, max_bytes or sys.maxsize, keep_parts)
        self.trackers = trackers
        self.undeclared = UndeclaredKeys()  # a key the metrics contract lacks is logged once, the row kept
        self.writer: BackgroundWriter[dict[str, Any]] = BackgroundWriter("metrics", self._write_rows, capacity)

    @property
    def dropped(self) -> int:
        return self.writer.dropped

    def write(self, row: dict[str, Any]) -> None:
        """Queue ``row``, stamped with the time now (not when it is written)."""
        self.writer.put({"time": round(time.time(), 3), **row})

    def flush(self) -> None:
        """Wait until every row written so far is in the file and with the trackers."""
        self.writer.flush()

    def close(self) -> None:
        """Write what is queued, then close the trackers (a W&B run finished)."""
        self.writer.close()
        if self.trackers is not None:
            self.trackers.close()

    def _write_rows(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.undeclared.note(row)
        self.file.write_lines([json.dumps(row) + "\n" for row in rows])
        if self.trackers is not None:
            for row in rows:
                self.trackers.write(row)


def post_alert(alerts: AlertsConfig, payload: dict[str, Any]) -> None:
    """``payload`` to the alert webhook, with its retries, in the background."""
    post_webhook(alerts.webhook_url, payload, retries=alerts.webhook_retries, backoff_s=alerts.webhook_backoff_s)


# Events that are alerts for the sink: a rule's firing, and a dependency refusing a stage (status.RefusalWatch),
# which no rule judges since no metric row could say which status it got.
ALERTING = (Event.ALERT, Event.DEPENDENCY_REFUSED)


class AlertSink:
    """The trainer's sinks of an alert beyond the log and the events file: a metrics row (which the trackers show
    as a text event), the Prometheus counter, and the webhook when one is configured."""

    def __init__(self, settings: ConfigSource, metrics: MetricsLog, telemetry: TrainerMetrics, progress: Progress):
        self.settings = settings
        self.metrics = metrics
        self.telemetry = telemetry
        self.progress = progress

    def write(self, entry: JournalEntry) -> None:
        if entry.event not in ALERTING:
            return
        rule, severity = entry.fields["rule"], entry.fields["severity"]
        self.telemetry.record_alert(rule, severity)
        self.metrics.write(
            {
                "step": self.progress.step,
                "alert": rule,
                "alert_severity": severity,
                "config_version": self.settings.version,
            }
        )
        cfg = self.settings.cfg
        if cfg.alerts.webhook_url:
            payload = {
                "run_id": cfg.run_id,
                **entry.fields,
                "step": entry.step,
                "time": round(time.time(), 3),
                "message": entry.message,
            }
            post_alert(cfg.alerts, payload)


class AlertResponder:
    def __init__(
        self,
        settings: ConfigSource,
        alerts: AlertEvaluator,
        control: Control,
        checkpoints: CheckpointStore | None,  # None: no rollback action can be taken (an alert drill's)
        rollback: Rollback | None,
        progress: Progress,
        metrics: MetricsLog,
        journal: Journal,
    ):
        self.settings = settings
        self.alerts = alerts
        self.control = control
        self.checkpoints = checkpoints
        self.rollback = rollback
        self.progress = progress
        self.metrics = metrics
        self.journal = journal
        self.alert_rollbacks: dict[str, int] = {}  # rule -> the step its last rollback went to
        self.heartbeat = Heartbeat()
        control.on_unpause.append(self.operator_resumed)

    def operator_resumed(self) -> None:
        self.alert_rollbacks.clear()  # the operator has looked: rules may roll back again
        self.alerts.restart_absence_clocks(time.time())  # no step was due while paused

    async def report(self, row: dict[str, Any]) -> None:
        """Write ``row`` to the metrics file and judge it."""
        self.metrics.write(row)
        await self.watch(row)

    async def watch(self, row: dict[str, Any]) -> None:
        """Feed a metrics row to the alert rules and carry out what fires."""
        if not self.settings.cfg.alerts.enabled:
            return
        now = time.time()
        alerts_cfg = self.settings.cfg.alerts
        if alerts_cfg.webhook_url and self.heartbeat.due(now, alerts_cfg.heartbeat_s):
            post_alert(alerts_cfg, Heartbeat.payload(self.settings.cfg.run_id, self.progress.step, now))
        firings = self.alerts.observe(row, now)
        if self.control.running:  # paused or stopping, no step is due: its metrics are not absent
            firings += self.alerts.check_absent(now)
        for firing in firings:
            await self.act_on(firing)

    async def act_on(self, firing: Firing) -> None:
        reason = f"alert {firing.rule}: {firing.message}"
        taken = []
        for action in firing.actions:
            if action == "pause":
                await self.control.pause(reason, by=HoldSource.ALERT)
            elif action == "stop":
                await self.control.request_stop(reason, by=HoldSource.ALERT)
            elif action == "rollback":
                # Between steps, like an operator's rollback: never in the middle of this step's bookkeeping.
                self.control.submit(lambda: self.rollback_for(firing))
            taken.append(action)
        level = logging.ERROR if firing.severity == "critical" else logging.WARNING
        details = {k: v for k, v in firing.as_dict().items() if k not in ("message", "step", "time")}
        self.journal.emit(
            Event.ALERT, firing.message, level=level, step=firing.step, alert=True, **details, actions_taken=taken
        )

    async def rollback_for(self, firing: Firing) -> None:
        """An alert's rollback; nobody awaits it, so a failure holds the run for an operator instead of raising."""
        try:
            await self._rollback_for(firing)
        except Exception as error:
            log_event(
                log,
                Event.ALERT_ROLLBACK_FAILED,
                level=logging.ERROR,
                alert=True,
                rule=firing.rule,
                error=repr(error)[:500],
            )
            await self.control.pause(f"alert {firing.rule}: rollback failed: {error}", by=HoldSource.ALERT)

    async def _rollback_for(self, firing: Firing) -> None:
        if self.checkpoints is None or self.rollback is None:
            raise RuntimeError("this responder was given no checkpoints to roll back to")
        rule = next((r for r in self.settings.cfg.alerts.rules if r.name == firing.rule), None)
        before = (firing.step if firing.step is not None else self.progress.step) - (rule.window_steps if rule else 1)
        target = await asyncio.to_thread(self.checkpoints.latest_stable)
        if target is None:
            target = max((s for s in await asyncio.to_thread(self.checkpoints.steps) if s <= before), default=None)
        if target is None:
            await self.control.pause(
                f"alert {firing.rule}: no stable checkpoint and none from before step {before} to roll back to",
                by=HoldSource.ALERT,
            )
            return
        if self.alert_rollbacks.get(firing.rule) == target:
            # The same trouble right after going back to the same step: another rollback would loop.
            await self.control.pause(
                f"alert {firing.rule}: fired again after rolling back to step {target}; waiting for an operator",
                by=HoldSource.ALERT,
            )
            return
        self.alert_rollbacks[firing.rule] = target
        await self.rollback(target, f"alert {firing.rule}")
