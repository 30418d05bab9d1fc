"""``rlpipe alerts test [RULE]``: a synthetic firing of alert rules through every configured sink.

The drill does not imitate the trainer: it hands a firing of each rule to the trainer's own
``AlertResponder.act_on``, the one path every real firing takes, with the run's config. So
the firing lands where the operator looks for alerts: a JSON ``alert`` log line (on this
command's stderr), an ``alert`` event in ``runs/<run>/events.jsonl``, an ``alert`` row in
the run's metrics file, the ``rlpipe_alerts_fired_total{rule,severity}`` counter on a
Prometheus endpoint (this process's own, on a free port, scraped by the drill), and a POST to
``alerts.webhook_url``. Each sink is then checked for it. The firing carries only the
``notify`` action, whatever the rule says, and its message says it is a drill: nothing is
paused, stopped or rolled back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import urllib.request
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from services.common.config import AlertRule, RunConfig
from services.common.observe.events import Event, EventLog, Journal
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.logs import JsonlFollower, setup_logging
from services.common.observe.records import event_records, metrics_rows
from services.common.observe.telemetry import start_telemetry
from services.trainer.alerts import AlertEvaluator, Firing
from services.trainer.control import Control
from services.trainer.progress import Progress
from services.trainer.responder import AlertResponder, AlertSink, MetricsLog

SINKS = ("log", "events", "metrics", "prometheus", "webhook")
DRILL_NOTE = "drill: a synthetic firing from `rlpipe alerts test`; no action is taken"


@dataclass(frozen=True)
class SinkResult:
    sink: str
    ok: bool
    detail: str


@dataclass
class _InForce:
    """The config in force, as the responder reads it."""

    cfg: RunConfig
    version: int = 0


class _NoHolds:
    """A drill fires only ``notify``: it never pauses or stops the run, so it never stores a hold."""

    async def put_control(self, control: dict[str, Any]) -> None:
        raise RuntimeError("an alert drill does not hold the run")

    async def get_control(self) -> dict[str, Any]:
        return {}


class _Records(logging.Handler):
    """The log records of the drill, as (event, fields)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.getMessage(), getattr(record, "fields", {})))


def select_rules(cfg: RunConfig, name: str | None) -> list[AlertRule]:
    """The rule called ``name``, or every configured rule; KeyError naming the known rules for an unknown name."""
    rules = cfg.alerts.rules
    if name is None:
        return list(rules)
    chosen = [rule for rule in rules if rule.name == name]
    if not chosen:
        raise KeyError(f"no alert rule {name!r} in this config (rules: {', '.join(r.name for r in rules)})")
    return chosen


def drill_firing(rule: AlertRule) -> Firing:
    return Firing(
        rule=rule.name,
        metric=rule.metric,
        condition=rule.condition,
        value=rule.threshold,
        threshold=rule.threshold,
        window="drill",
        severity=rule.severity,
        actions=["notify"],
        time=time.time(),
        message=f"[{rule.severity}] {rule.name}: {DRILL_NOTE}",
    )


def _fired_counts(metrics_url: str) -> dict[str, float]:
    """rule -> rlpipe_alerts_fired_total as the Prometheus endpoint shows it."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rlpipe_alerts_fired_total":
                rule = sample.labels.get("rule", "")
                counts[rule] = counts.get(rule, 0.0) + sample.value
    return counts


def _missing(names: list[str], found: Container[str | None]) -> str:
    return ", ".join(name for name in names if name not in found)


def run_drill(cfg: RunConfig, rules: list[AlertRule]) -> list[SinkResult]:
    """Fire each of ``rules`` once through the trainer's alert path and check every sink; one result per sink."""
    # A free port: the trainer on this machine may hold the configured one.
    cfg = cfg.model_copy(update={"telemetry": cfg.telemetry.model_copy(update={"metrics_port": 0})})
    setup_logging("alert-drill", cfg.run_id, cfg.service.log_level)
    records = _Records()
    logging.getLogger().addHandler(records)
    telemetry = start_telemetry(cfg, "operator", "alert-drill")
    events_path, metrics_path = cfg.run_dir / "events.jsonl", cfg.metrics_file
    # The trainer may write and roll both files meanwhile: followers read on across rolls, from what is there now.
    new_events, new_metrics = JsonlFollower(events_path).skip_to_end(), JsonlFollower(metrics_path).skip_to_end()
    progress, settings, metrics = Progress(), _InForce(cfg), MetricsLog(metrics_path)
    journal = Journal(EventLog.of_run(cfg), [AlertSink(settings, metrics, TrainerMetrics(), progress)])
    responder = AlertResponder(
        settings,
        AlertEvaluator(rules, cfg.alerts.cooldown_steps),
        Control(_NoHolds(), journal, progress),
        checkpoints=None,  # only a rollback action reads checkpoints, and a drill fires none
        rollback=None,
        progress=progress,
        metrics=metrics,
        journal=journal,
    )

    async def fire_all() -> None:
        for rule in rules:
            await responder.act_on(drill_firing(rule))

    asyncio.run(fire_all())
    responder.metrics.close()
    # The webhook POSTs run on their own threads, each bounded by its timeout and alerts.webhook_retries:
    # wait for every outcome, retries included, so a failure after the last retry is seen.
    for thread in threading.enumerate():
        if thread.name == "alert-webhook":
            thread.join()
    logging.getLogger().removeHandler(records)

    names = [rule.name for rule in rules]
    logged = {fields.get("rule") for event, fields in records.seen if event == Event.ALERT}
    evented = {event.rule for event in event_records(new_events.new_rows()) if event.kind == Event.ALERT}
    rowed = {row.alert for row in metrics_rows(new_metrics.new_rows())}
    results = [
        _result("log", names, logged, "alert lines on stderr"),
        _result("events", names, evented, f"alert events in {events_path}"),
        _result("metrics", names, rowed, f"alert rows in {metrics_path}"),
    ]
    try:
        counted = {rule for rule, count in _fired_counts(telemetry.metrics_url).items() if count >= 1}
        results.append(_result("prometheus", names, counted, f"rlpipe_alerts_fired_total at {telemetry.metrics_url}"))
    except OSError as error:
        results.append(SinkResult("prometheus", False, f"{telemetry.metrics_url} could not be scraped: {error}"))
    results.append(_webhook_result(cfg, len(names), records))
    return results


def _result(sink: str, names: list[str], found: Container[str | None], where: str) -> SinkResult:
    missing = _missing(names, found)
    if missing:
        return SinkResult(sink, False, f"no {where} for {missing}")
    return SinkResult(sink, True, f"{len(names)} {where}")


def _webhook_result(cfg: RunConfig, firings: int, records: _Records) -> SinkResult:
    if not cfg.alerts.webhook_url:
        return SinkResult("webhook", True, "not configured (alerts.webhook_url is empty)")
    failures = [fields for event, fields in records.seen if event == "alert_webhook_failed"]
    if failures:
        first = failures[0]
        return SinkResult(
            "webhook",
            False,
            f"{len(failures)} of {firings} POSTs to {first.get('url')} failed "
            f"(after {first.get('attempts', 1)} attempts): {first.get('error')}",
        )
    return SinkResult("webhook", True, f"{firings} POSTs accepted")
