"""A replica held by a refusing dependency reaches the run's events (and the alert sink) as soon as the trainer reads
its presence entry: not after the redelivery bound a passing outage is given."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from services.common.config import AlertsConfig
from services.common.observe.events import EventLog, Journal
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.logs import jsonl_parts
from services.common.transport.breaker import Refusal
from services.common.transport.presence import SeenService, roles_refused
from services.trainer.progress import Progress
from services.trainer.responder import AlertSink, MetricsLog
from services.trainer.status import RefusalWatch

pytestmark = pytest.mark.unit

REFUSED = Refusal("http_401", "compute", "DependencyRefused('HTTP 401 from http://rm/score')", since=100.0)


def seen(instance: str, refused: Refusal | None = None, up: bool = True) -> SeenService:
    role = instance.rpartition("-")[0]
    return SeenService(role=role, instance=instance, time=0.0, last_seen_s=0.0, up=up, restarts=0, refused=refused)


def rows(path) -> list[dict]:
    return [json.loads(line) for part in jsonl_parts(path) for line in part.read_text().splitlines()]


def test_a_refused_replica_is_recorded_once_as_an_alert_naming_the_status_and_its_end_once(tmp_path):
    settings = SimpleNamespace(cfg=SimpleNamespace(alerts=AlertsConfig(), run_id="run"), version=1)
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    sink = AlertSink(settings, metrics, TrainerMetrics(), Progress(step=3))
    watch = RefusalWatch(Journal(EventLog(tmp_path / "events.jsonl"), [sink]))

    watch.observe([seen("reward-0", REFUSED), seen("rollout-0")], step=3)
    watch.observe([seen("reward-0", REFUSED), seen("rollout-0")], step=3)  # still held: said once
    watch.observe([seen("reward-0", REFUSED, up=False)], step=3)  # gone, not recovered: nothing
    watch.observe([seen("reward-0")], step=4)
    refused, recovered = rows(tmp_path / "events.jsonl")
    assert (refused["kind"], refused["rule"], refused["severity"]) == (
        "dependency_refused",
        "dependency_refused",
        "critical",
    )
    assert (refused["instance"], refused["refusal"], refused["step"]) == ("reward-0", "http_401", 3)
    assert "reward-0 (reward) is held: its compute is refused (http_401)" in refused["message"]
    assert "HTTP 401" in refused["message"]
    assert (recovered["kind"], recovered["instance"]) == ("dependency_recovered", "reward-0")
    metrics.flush()
    assert [row.get("alert") for row in rows(tmp_path / "metrics.jsonl")] == ["dependency_refused"]


def test_only_live_replicas_count_as_refused_roles():
    entries = [seen("reward-0", REFUSED), seen("reward-1"), seen("rollout-0", REFUSED, up=False)]
    assert roles_refused(entries) == ["reward"]
