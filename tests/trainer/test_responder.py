"""The alert responder alone: a firing's rollback goes through the command queue, never loops, and pauses on failure."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from services.common.config import AlertRule, AlertsConfig, CheckpointConfig
from services.common.observe.events import Event, EventLog, Journal
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.records import read_jsonl
from services.common.observe.trackers import TrackerFanout
from services.common.transport.live_config import Hold
from services.common.transport.storage import open_store
from services.trainer.alerts import AlertEvaluator
from services.trainer.checkpointing.state import Checkpoint, TrainerState, rng_state
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.control import Control, RunState
from services.trainer.progress import Progress
from services.trainer.responder import AlertResponder, AlertSink, MetricsLog
from tests.support.trainer import Holds, StuckTracker

pytestmark = pytest.mark.unit

KL_RULE = AlertRule(name="kl_high", metric="kl", condition="above", threshold=1.0, actions=["notify", "rollback"])


def stored_steps(tmp_path, steps: list[int]) -> CheckpointStore:
    store = CheckpointStore(open_store(tmp_path.as_uri(), CheckpointConfig()), "run", keep_last=10, incarnation="i")
    for step in steps:
        state = TrainerState(step=step, policy_version=step, last_experience_seq=step, incarnation="i")
        store.save(Checkpoint(step, {}, {}, {}, rng_state(), state), tmp_path)
    return store


def responder(tmp_path, store: CheckpointStore, rollback) -> tuple[AlertResponder, Control, Progress]:
    alerts = AlertsConfig(rules=[KL_RULE], cooldown_steps=0)
    settings = SimpleNamespace(cfg=SimpleNamespace(alerts=alerts, run_id="run"), version=3)  # the config in force
    progress = Progress(step=12)
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    journal = Journal(EventLog(tmp_path / "events.jsonl"), [AlertSink(settings, metrics, TrainerMetrics(), progress)])
    control = Control(Holds(), journal, progress)
    evaluator = AlertEvaluator(alerts.rules, alerts.cooldown_steps)
    alert = AlertResponder(settings, evaluator, control, store, rollback, progress, metrics, journal)
    return alert, control, progress


def test_a_rollback_action_runs_between_steps_and_goes_to_the_newest_step_before_the_window(tmp_path):
    async def scenario() -> None:
        calls: list[tuple[Any, str]] = []

        async def rollback(step, reason):
            calls.append((step, reason))

        alert, control, _ = responder(tmp_path, stored_steps(tmp_path, [5, 10, 12]), rollback)
        await alert.report({"step": 12, "kl": 3.0})
        assert calls == []  # queued, not run inside the step's bookkeeping
        await control.run_commands()
        assert calls == [(10, "alert kl_high")]  # window 1 step: the newest step saved before step 12 is 10
        alert.metrics.flush()  # rows are written on the writer's thread
        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r.get("alert") for r in rows] == [None, "kl_high"]

    asyncio.run(scenario())


def test_firing_again_after_rolling_back_to_the_same_step_pauses_instead_of_looping(tmp_path):
    async def scenario() -> None:
        calls: list[int] = []

        async def rollback(step, reason):
            calls.append(step)

        alert, control, progress = responder(tmp_path, stored_steps(tmp_path, [10]), rollback)
        await alert.report({"step": 12, "kl": 3.0})
        await control.run_commands()
        progress.step = 12
        await alert.report({"step": 13, "kl": 3.0})
        await control.run_commands()
        assert calls == [10]
        assert control.state == RunState.PAUSED
        assert "fired again after rolling back to step 10" in control.paused_reason
        await control.unpause()  # the operator has looked: the rule may roll back again
        await alert.report({"step": 14, "kl": 3.0})
        await control.run_commands()
        assert calls == [10, 10]

    asyncio.run(scenario())


def test_a_rollback_that_fails_pauses_the_run_with_the_reason(tmp_path):
    async def scenario() -> None:
        async def rollback(step, reason):
            raise RuntimeError("store unreachable")

        alert, control, _ = responder(tmp_path, stored_steps(tmp_path, [10]), rollback)
        await alert.report({"step": 12, "kl": 3.0})
        await control.run_commands()
        assert control.state == RunState.PAUSED
        assert control.paused_reason == "alert kl_high: rollback failed: store unreachable"
        assert Hold.of_record(control.holds.stored).outlives_resume  # rlpipe run --resume leaves it for an operator

    asyncio.run(scenario())


def test_a_metrics_row_is_handed_over_while_a_tracker_is_still_blocked_and_reaches_file_and_tracker_at_close(
    tmp_path,
):
    tracker = StuckTracker()
    metrics = MetricsLog(tmp_path / "metrics.jsonl", TrackerFanout({"stuck": tracker}))
    metrics.write({"step": 1, "loss": 0.5})
    assert tracker.entered.wait(10)  # the tracker now holds row 1 in its log call
    metrics.write({"step": 2, "loss": 0.25})  # returns: a step does not wait for the tracker
    assert tracker.steps == []
    tracker.release.set()
    metrics.close()
    assert tracker.steps == [1, 2]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["loss"]) for row in rows] == [(1, 0.5), (2, 0.25)]
    assert metrics.dropped == 0


def test_a_row_with_a_key_the_metrics_contract_lacks_is_written_whole_and_the_key_logged_once(tmp_path, caplog):
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    with caplog.at_level(logging.WARNING, logger="services.common.observe.metrics"):
        metrics.write({"step": 1, "reward_mean": 0.5, "made_up/ratio": 0.25})
        metrics.write({"step": 2, "reward_mean": 0.75, "made_up/ratio": 0.5, "entropy": 1.0})
        metrics.close()
    # Nothing is lost for a gap in the contract: both rows are on disk as they were written.
    written = read_jsonl(tmp_path / "metrics.jsonl")
    assert [{k: v for k, v in row.items() if k != "time"} for row in written] == [
        {"step": 1, "reward_mean": 0.5, "made_up/ratio": 0.25},
        {"step": 2, "reward_mean": 0.75, "made_up/ratio": 0.5, "entropy": 1.0},
    ]
    said = [record for record in caplog.records if record.getMessage() == Event.UNDECLARED_METRIC]
    assert [record.fields for record in said] == [{"key": "made_up/ratio"}]  # once, though two rows carried it
