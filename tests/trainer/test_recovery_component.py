"""Recovery alone, on a real tiny learner and a file:// store: adopt is all-or-nothing, versions only grow."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest
import torch

from services.common.config import CheckpointConfig, load_config
from services.common.model.datasets import load_jsonl
from services.common.observe.events import EventLog
from services.common.observe.telemetry import TrainerMetrics
from services.common.transport.storage import open_store
from services.common.transport.weightsync import WeightSyncServer, snapshot_of
from services.trainer.checkpoint import CheckpointStore, ForeignCheckpoints
from services.trainer.intake import Fate, GroupLedger, PromptFeeder
from services.trainer.learner import Learner
from services.trainer.lineage import Lineage
from services.trainer.progress import Progress
from services.trainer.recovery import Recovery
from tests.conftest import write_config

pytestmark = pytest.mark.integration


class ExperienceStream:
    """The broker as Recovery sees it: one EXPERIENCE stream that remembers its purges, and the claim-checked bodies.
    (The real broker's purges are exercised end to end in tests/test_exactly_once.py.)"""

    def __init__(self) -> None:
        self.created = datetime(2026, 1, 1, tzinfo=UTC)
        self.purged_below: list[int] = []
        self.deleted_claims: list[str] = []
        self.run_id = "run"
        self.js = self
        self.claims = self

    async def stream_created(self, edge: str) -> datetime:
        return self.created

    async def purge_stream(self, name: str, seq: int) -> None:
        self.purged_below.append(seq)

    def delete(self, keys: list[str]) -> None:
        self.deleted_claims += keys


class Harness:
    """One trainer process's recovery and what it touches; a second Harness on the same folder is a restart."""

    def __init__(self, tiny_model, tmp_path, stream: ExperienceStream | None = None, **checkpoint: Any):
        model_dir, data_dir = tiny_model
        self.cfg = load_config(
            write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", checkpoint=checkpoint)
        )
        torch.manual_seed(0)
        self.learner = Learner(self.cfg)
        self.checkpoints = CheckpointStore(
            open_store((tmp_path / "store").as_uri(), CheckpointConfig()),
            "run",
            keep_last=checkpoint.get("keep_last", 10),
        )
        self.stream = stream or ExperienceStream()
        self.lineage = Lineage(tmp_path / "runs" / "lineage.jsonl")
        self.progress = Progress()
        self.ledger = GroupLedger()
        self.weights = WeightSyncServer(snapshot_of(self.learner.model, 0, 0))
        self.rows: list[dict[str, Any]] = []
        self.rewinds = 0
        settings = type("Settings", (), {"cfg": self.cfg, "version": 0})()
        self.recovery = Recovery(
            settings,
            self.learner,
            self.checkpoints,
            self.lineage,
            self.progress,
            self.ledger,
            PromptFeeder(load_jsonl(data_dir / "train.jsonl"), 0, shuffle=False),
            self.weights,
            bus=self.stream,
            events=EventLog(tmp_path / "runs" / "events.jsonl"),
            telemetry=TrainerMetrics(),
            report=self.report,
            rewind=self.rewind,
        )

    async def report(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def rewind(self) -> None:
        self.rewinds += 1

    async def step_and_save(self, step: int, groups: list[str]) -> None:
        """What the loop does for a step, minus the math: the weights move so each step's are told apart."""
        with torch.no_grad():
            next(self.learner.model.parameters()).add_(1.0)
        self.progress.step, self.progress.version, self.progress.applied_seq = step, step, step * 10
        self.ledger.settle(groups, step, Fate.APPLIED)
        self.lineage.record_step(step, step, [(g, step - 1) for g in groups], [], step * 10)
        await self.recovery.save(config_version=0, wait=True)


def first_weights(learner: Learner) -> torch.Tensor:
    return next(learner.model.parameters()).detach().clone()


@pytest.fixture
def saved_run(tiny_model, tmp_path):
    """A run that saved steps 1, 2 and 3 and then died."""

    async def run() -> torch.Tensor:
        first = Harness(tiny_model, tmp_path)
        assert not await first.recovery.start(resume=False)
        for step in (1, 2, 3):
            await first.step_and_save(step, [f"e0-i{step}"])
            if step == 2:
                at_two = first_weights(first.learner)
        return at_two

    return asyncio.run(run())


def test_a_resume_from_an_older_step_abandons_the_later_ones_and_serves_a_newer_version(
    tiny_model, tmp_path, saved_run
):
    async def scenario() -> None:
        restarted = Harness(tiny_model, tmp_path, resume_step=2)
        assert await restarted.recovery.start(resume=True)
        progress = restarted.progress
        assert (progress.step, progress.version, progress.applied_seq) == (2, 4, 20)
        assert torch.equal(first_weights(restarted.learner), saved_run)
        assert progress.abandoned_versions == [(3, 3)]  # step 3 made version 3: its groups are dropped
        assert restarted.checkpoints.steps() == [1, 2]  # step 3 is marked ABANDONED
        # e0-i1's EXPERIENCE was purged after step 1 was saved: no reader meets it again, so step 2 forgot it.
        assert sorted(restarted.ledger.settled) == ["e0-i2"]
        assert restarted.weights.latest.version == 4 and restarted.rewinds == 1
        assert restarted.lineage.records()[-1]["abandoned_steps"] == [3]

    asyncio.run(scenario())


def test_an_adopt_that_cannot_mark_the_later_steps_changes_nothing(tiny_model, tmp_path, saved_run):
    async def scenario() -> None:
        restarted = Harness(tiny_model, tmp_path, resume_step=2)
        before = first_weights(restarted.learner)
        lineage_before = restarted.lineage.text()

        def store_down(step: int) -> list[int]:
            raise OSError("store unreachable")

        restarted.checkpoints.abandon_after = store_down
        with pytest.raises(OSError, match="store unreachable"):
            await restarted.recovery.start(resume=True)
        assert (restarted.progress.step, restarted.progress.version) == (0, 0)
        assert torch.equal(first_weights(restarted.learner), before)
        assert restarted.lineage.text() == lineage_before
        assert restarted.weights.latest.version == 0 and restarted.rewinds == 0

    asyncio.run(scenario())


def test_a_rollback_that_cannot_mark_the_later_steps_changes_nothing_and_a_retry_goes_through(tiny_model, tmp_path):
    """The rollback path of adopt: the store refuses to mark steps 2 and 3 abandoned, so the running trainer keeps
    its step, version, weights, ledger, reader and lineage; the same call, once the store answers, rolls back."""

    async def scenario() -> None:
        run = Harness(tiny_model, tmp_path)
        await run.recovery.start(resume=False)
        for step in (1, 2, 3):
            await run.step_and_save(step, [f"e0-i{step}"])
            if step == 1:
                at_one = first_weights(run.learner)
        at_three = first_weights(run.learner)
        progress_before = dataclasses.replace(run.progress, abandoned_versions=list(run.progress.abandoned_versions))
        settled_before = {g: (s.step, s.fate) for g, s in run.ledger.settled.items()}
        in_flight_before = dict(run.ledger.in_flight)
        lineage_before = run.lineage.text()
        served_before = run.weights.latest

        def store_down(step: int) -> list[int]:
            raise OSError("store unreachable")

        run.checkpoints.abandon_after = store_down
        with pytest.raises(OSError, match="store unreachable"):
            await run.recovery.rollback(1, reason="test")
        assert run.progress == progress_before
        assert torch.equal(first_weights(run.learner), at_three)
        assert run.weights.latest is served_before and run.rewinds == 0  # nothing published, nothing re-read
        assert {g: (s.step, s.fate) for g, s in run.ledger.settled.items()} == settled_before
        assert run.ledger.in_flight == in_flight_before
        assert run.lineage.text() == lineage_before
        assert run.checkpoints.steps() == [1, 2, 3]  # nothing marked

        del run.checkpoints.abandon_after  # the store answers again
        assert await run.recovery.rollback(1, reason="test") == (1, 4, [2, 3])
        assert (run.progress.step, run.progress.version, run.progress.applied_seq) == (1, 4, 10)
        assert run.progress.abandoned_versions == [(2, 3)]
        assert torch.equal(first_weights(run.learner), at_one)
        assert run.weights.latest.version == 4 and run.rewinds == 1
        assert run.checkpoints.steps() == [1]
        assert {g: s.fate for g, s in run.ledger.settled.items()} == {"e0-i1": Fate.APPLIED}
        assert run.lineage.records()[-1]["event"] == "rollback"

    asyncio.run(scenario())


def test_a_trainer_restarted_before_its_first_checkpoint_serves_versions_past_those_it_served(tiny_model, tmp_path):
    async def scenario() -> None:
        first = Harness(tiny_model, tmp_path)
        await first.recovery.start(resume=False)
        for step in (1, 2, 3):  # steps taken, none saved
            first.lineage.record_step(step, step, [(f"e0-i{step}", step - 1)], [], step)
        restarted = Harness(tiny_model, tmp_path)
        assert not await restarted.recovery.start(resume=True)
        assert restarted.progress.version == 4 and restarted.weights.latest.version == 4
        assert restarted.progress.abandoned_versions == [(1, 3)]
        assert restarted.lineage.records()[-1]["abandoned_steps"] == [1, 2, 3]
        assert restarted.progress.incarnation not in ("", first.progress.incarnation)

    asyncio.run(scenario())


def test_a_fresh_start_refuses_a_prefix_that_holds_checkpoints(tiny_model, tmp_path, saved_run):
    async def scenario() -> None:
        fresh = Harness(tiny_model, tmp_path)
        with pytest.raises(ForeignCheckpoints, match="--resume"):
            await fresh.recovery.start(resume=False)

    asyncio.run(scenario())


def test_a_stable_step_older_than_the_kept_window_does_not_hold_experience_back(tiny_model, tmp_path):
    """Purges follow the newest keep_last steps; a rollback to an older STABLE step reads on after the purge (the
    groups it had in flight there are written off once overdue) instead of taking the gap for a lost broker."""

    async def scenario() -> None:
        run = Harness(tiny_model, tmp_path, keep_last=2)
        await run.recovery.start(resume=False)
        await run.step_and_save(1, ["e0-i1"])
        run.checkpoints.mark(1, "STABLE")
        for step in (2, 3, 4):
            await run.step_and_save(step, [f"e0-i{step}"])
        assert run.checkpoints.steps() == [1, 3, 4]  # the STABLE step is kept...
        assert run.stream.purged_below == [11, 21, 31]  # ...but EXPERIENCE goes on being purged past it
        assert run.checkpoints.purged_through(str(run.stream.created)) == 30

        step, version, _ = await run.recovery.rollback(None, reason="test")
        assert (step, version) == (1, 5)
        assert run.progress.applied_seq == 30  # read on after the purge, not from step 1's sequence 10
        # A stream created anew (a broker that lost its store) voids the record: the gap is not taken for a purge.
        assert run.checkpoints.purged_through(str(datetime(2026, 2, 1, tzinfo=UTC))) == 0

    asyncio.run(scenario())


def test_without_periodic_checkpoints_everything_read_is_purged_and_a_restart_reads_on_after_it(tiny_model, tmp_path):
    async def scenario() -> None:
        first = Harness(tiny_model, tmp_path, save_every_steps=0)
        await first.recovery.start(resume=False)
        first.progress.applied_seq = 42
        await first.recovery.purge_consumed()
        assert first.stream.purged_below == [43]
        await first.recovery.purge_consumed()
        assert first.stream.purged_below == [43]  # nothing new read: no second purge

        restarted = Harness(tiny_model, tmp_path, stream=first.stream, save_every_steps=0)
        assert not await restarted.recovery.start(resume=True)  # no checkpoint to resume
        assert restarted.progress.applied_seq == 42

    asyncio.run(scenario())


def test_claim_bodies_read_before_a_restart_are_deleted_once_the_resumed_trainer_purges_past_them(tiny_model, tmp_path):
    """Each checkpoint carries the claim-checked bodies read since the replay floor (#11 item 8): a resumed trainer
    deletes those its predecessor read once no kept step re-reads them. Without the keys in the checkpoint the new
    process knew only the bodies it read itself, and the old ones stayed in the store for ever."""

    async def scenario() -> None:
        first = Harness(tiny_model, tmp_path, keep_last=2)
        await first.recovery.start(resume=False)
        for step in (1, 2):
            first.recovery.track_claims([(step * 10, f"run/claims/experience/g{step}")])
            await first.step_and_save(step, [f"e0-i{step}"])
        # Step 1's save purged through its own sequence 10; step 2's left the floor at 10 (step 1 is still kept).
        assert first.stream.deleted_claims == ["run/claims/experience/g1"]

        restarted = Harness(tiny_model, tmp_path, stream=first.stream, keep_last=2)
        assert await restarted.recovery.start(resume=True)
        assert restarted.recovery.claim_keys == {"run/claims/experience/g2": 20}
        await restarted.step_and_save(3, ["e0-i3"])  # keeps steps 2 and 3: the floor moves to step 2's sequence 20
        assert first.stream.purged_below == [11, 21]
        assert first.stream.deleted_claims == ["run/claims/experience/g1", "run/claims/experience/g2"]
        assert restarted.recovery.claim_keys == {}

    asyncio.run(scenario())
