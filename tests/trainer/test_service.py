"""The trainer's driver on non-finite numbers: a step that would put NaN into the weights is skipped with an event,
the nan_loss rule's action (pause) runs, and NaN weights are neither served to rollouts nor saved.

A real trainer (tiny learner, real nats-server, its file checkpoint store), driven one step at a time."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
import torch

from services.common.model.datasets import load_jsonl
from services.common.observe.timeshare import StepPhase, TimeShare
from services.common.observe.trackers import TrackerFanout
from services.trainer.control import RunState
from services.trainer.intake.reader import Collected
from tests.support.trainer import StuckTracker, experience, start_trainer, trainer_config, with_nan

pytestmark = pytest.mark.integration


@pytest.fixture
def cfg(tiny_model, tmp_path, nats_url, monkeypatch):
    monkeypatch.setenv("RLPIPE_ADMIN_TOKEN", "s3cret")
    return trainer_config(tmp_path, tiny_model, nats_url)


def events(cfg, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == kind]


def test_a_step_with_nan_rewards_is_skipped_pauses_the_run_and_rollouts_keep_finite_weights(cfg, tiny_model):
    groups = experience(cfg, load_jsonl(tiny_model[1] / "train.jsonl")[:4])

    async def scenario() -> None:
        trainer = await start_trainer(cfg)
        base = dict(trainer.learner.snapshot(version=0, step=0).tensors)
        try:
            await trainer.train_step(Collected(batch=with_nan(groups, 1, "rewards"), dropped=[], sequence=4))
            await trainer.recovery.publisher.drain()
            served = trainer.recovery.weights.latest
            assert served.version == 1
            assert all(torch.equal(tensor, base[name]) for name, tensor in served.tensors)
            [skipped] = events(cfg, "step_skipped")
            assert skipped["step"] == 1 and skipped["reason"] == "advantages are not finite"
            assert math.isnan(trainer.progress.last_row["loss"])
            assert trainer.control.state == RunState.PAUSED
            assert trainer.control.paused_reason.startswith("alert nan_loss: [critical] nan_loss at step 1")
        finally:
            trainer.responder.metrics.close()
            await trainer.bus.close()

    asyncio.run(scenario())


def test_nan_weights_are_neither_served_to_rollouts_nor_saved(cfg, tiny_model):
    groups = experience(cfg, load_jsonl(tiny_model[1] / "train.jsonl")[:4])

    async def scenario() -> None:
        trainer = await start_trainer(cfg)
        try:
            with torch.no_grad():  # a blow-up the step's own checks cannot undo: the weights are already NaN
                next(trainer.learner.model.parameters()).fill_(math.nan)
            await trainer.train_step(Collected(batch=groups, dropped=[], sequence=4))
            await trainer.recovery.publisher.drain()  # the version is offered in the background
            assert trainer.recovery.weights.latest.version == 0  # rollouts keep the base weights
            # The learner skipped the update (its loss is NaN), and the weights were kept from rollouts.
            reasons = [event["reason"] for event in events(cfg, "step_skipped")]
            assert any("policy version 1 (step 1) is not served" in reason for reason in reasons), reasons
            assert trainer.control.state == RunState.PAUSED
            await trainer.save(wait=True)
            assert trainer.checkpoints.steps() == []
            assert trainer.progress.saved_step == 0
        finally:
            trainer.responder.metrics.close()
            await trainer.bus.close()

    asyncio.run(scenario())


def test_a_step_rows_time_split_covers_the_whole_interval_since_the_previous_row(cfg, tiny_model):
    groups = experience(cfg, load_jsonl(tiny_model[1] / "train.jsonl")[:4])

    async def scenario() -> None:
        trainer = await start_trainer(cfg)
        try:
            trainer.step_time = TimeShare(StepPhase.BOOKKEEPING)
            started = time.monotonic()
            await trainer.train_step(Collected(batch=groups, dropped=[], sequence=4))
            wall = time.monotonic() - started
            row = trainer.progress.last_row
            split = {phase: row[f"time/{phase}_s"] for phase in StepPhase}
            assert sum(split.values()) == pytest.approx(wall, abs=0.01)  # every second of the interval, once
            assert split[StepPhase.WAIT] == 0.0 and split[StepPhase.EVAL] == 0.0  # no collect, no evaluation here
            assert split[StepPhase.COMPUTE] >= row["step_time_s"]  # the learner's own step is inside compute
            trainer.responder.metrics.flush()  # the row is written by the metrics writer's thread
            [written] = [json.loads(line) for line in cfg.metrics_file.read_text().splitlines() if '"loss"' in line]
            assert {key: written[key] for key in row if key.startswith("time/")} == {
                key: value for key, value in row.items() if key.startswith("time/")
            }
        finally:
            trainer.responder.metrics.close()
            await trainer.bus.close()

    asyncio.run(scenario())


def test_steps_go_on_while_an_experiment_tracker_is_stuck_and_it_gets_every_row_once_it_answers(cfg, tiny_model):
    """A tracker that does not return (an MLflow or W&B server that hangs) holds none of the trainer's steps: three
    steps complete while it is stuck in the first row's call, and once it answers it receives every step's row."""
    groups = experience(cfg, load_jsonl(tiny_model[1] / "train.jsonl")[:4])

    async def scenario() -> None:
        trainer = await start_trainer(cfg)
        tracker = StuckTracker()
        trainer.responder.metrics.trackers = TrackerFanout({"stuck": tracker})
        try:
            for sequence in (4, 8, 12):
                await trainer.train_step(Collected(batch=groups, dropped=[], sequence=sequence))
                assert await asyncio.to_thread(tracker.entered.wait, 10)  # stuck in the first row's log call
            assert trainer.progress.step == 3 and tracker.steps == []
            tracker.release.set()
        finally:
            tracker.release.set()
            trainer.responder.metrics.close()
            await trainer.bus.close()
        assert tracker.steps == [1, 2, 3]
        assert trainer.responder.metrics.dropped == 0

    asyncio.run(scenario())
