"""Recovery alone, on a real tiny learner and a file:// store: adopt is all-or-nothing, versions only grow."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import nats
import pytest
import torch

from services.common.model.datasets import load_jsonl
from services.common.observe.events import EventLog, Journal
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.logs import Stopwatch
from services.common.transport.lease_bucket import open_bucket as open_lease_bucket
from services.common.transport.storage import FileStore, ObjectStore, open_store
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import snapshot_of
from services.trainer.checkpointing.adopter import ResumeRefused
from services.trainer.checkpointing.lineage import Lineage
from services.trainer.checkpointing.manifest import FULL_FORMAT, UnknownCheckpointFormat
from services.trainer.checkpointing.recovery import AdoptionUnserved, Recovery
from services.trainer.checkpointing.resume import SavedRecord
from services.trainer.checkpointing.state import CheckpointMismatch
from services.trainer.checkpointing.step_reader import ForeignCheckpoints
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.intake.feeder import PromptFeeder
from services.trainer.intake.ledger import Fate, GroupLedger
from services.trainer.learning.learner import Learner
from services.trainer.progress import Progress
from services.trainer.served_versions import ServedVersions
from tests.support.runs import run_config

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


class FailingWeights(WeightSyncServer):
    """A weight server whose next ``failures`` publishes fail as a copy that cannot be taken would (host memory)."""

    failures = 0

    async def publish(self, snapshot) -> None:
        if self.failures:
            self.failures -= 1
            snapshot.release()
            raise MemoryError("no host memory for the weights' copy")
        await super().publish(snapshot)


class Harness:
    """One trainer process's recovery and what it touches; a second Harness on the same folder is a restart."""

    def __init__(
        self,
        tiny_model,
        tmp_path,
        stream: ExperienceStream | None = None,
        store: ObjectStore | None = None,
        served: ServedVersions | None = None,
        **checkpoint: Any,
    ):
        _, data_dir = tiny_model
        self.cfg = run_config(tmp_path, tiny_model, checkpoint=checkpoint)
        torch.manual_seed(0)
        self.learner = Learner(self.cfg)
        # A file:// store under tmp_path unless the test names one (an S3 endpoint's).
        url = self.cfg.checkpoint_url if "store_url" in checkpoint else (tmp_path / "store").as_uri()
        self.checkpoints = CheckpointStore(
            store or open_store(url, self.cfg.checkpoint),
            "run",
            keep_last=checkpoint.get("keep_last", 10),
            backoff_s=0.05,  # the store's own retries; the resume's wait is checkpoint.resume_wait_s
        )
        self.stream = stream or ExperienceStream()
        self.lineage = Lineage(tmp_path / "runs" / "lineage.jsonl")
        self.progress = Progress()
        self.ledger = GroupLedger()
        self.weights = FailingWeights(snapshot_of(self.learner.model, 0, 0))
        self.rows: list[dict[str, Any]] = []
        self.holds: list[str] = []  # the reasons the run was held for, as Control.pause would get them
        self.rewinds = 0
        self.events_path = tmp_path / "runs" / "events.jsonl"
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
            journal=Journal(EventLog(self.events_path)),
            telemetry=TrainerMetrics(),
            report=self.report,
            rewind=self.rewind,
            hold=self.hold,
            served=served,
        )

    async def hold(self, reason: str) -> None:
        self.holds.append(reason)

    async def report(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def rewind(self) -> None:
        self.rewinds += 1

    async def step_and_save(self, step: int, groups: list[str], final: bool = True) -> None:
        """What the loop does for a step, minus the math: the weights move so each step's are told apart.
        ``final``: a save at a stop or an end (waited for); otherwise a periodic one, uploaded in the background."""
        with torch.no_grad():
            next(self.learner.model.parameters()).add_(1.0)
        self.progress.step, self.progress.version, self.progress.applied_seq = step, step, step * 10
        self.ledger.settle(groups, step, Fate.APPLIED)
        self.lineage.record_step(step, step, [(g, step - 1) for g in groups], [], step * 10)
        await self.recovery.save(config_version=0, wait=final)
        await self.recovery.wait_for_upload()


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
        # Step 2's checkpoint keeps e0-i1 and e0-i2 under its watermark, by no name: a copy of either is refused.
        assert restarted.ledger.settled == {} and restarted.ledger.watermark() == "e0-i2"
        assert not restarted.ledger.arrived("e0-i1") and restarted.ledger.arrived("e0-i3")
        assert restarted.weights.latest.version == 4 and restarted.rewinds == 1
        assert restarted.lineage.records()[-1].abandoned_steps == [3]

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
        # The ledger's own watermark stands (step 1's checkpoint's is lower); the groups the abandoned steps applied
        # are in flight below it, to come again.
        assert run.ledger.settled == {} and run.ledger.watermark() == "e0-i3"
        assert sorted(run.ledger.in_flight) == ["e0-i2", "e0-i3"]
        assert run.lineage.records()[-1].event == "rollback"

    asyncio.run(scenario())


def test_a_rollback_whose_weights_cannot_be_served_is_not_done_holds_the_run_and_is_served_once_resumed(
    tiny_model, tmp_path
):
    """Before, a failed publish of the adopted weights left the rollback half-done (EXPERIENCE not re-read, raised
    past), and weights the server refused let it complete with the rollouts on the abandoned branch. Now the offer
    is retried; when it keeps failing the rollback is not done (no rollback event, AdoptionUnserved), the run is
    held, and the loop serves the weights before its next step once an operator resumes."""

    async def scenario() -> None:
        run = Harness(tiny_model, tmp_path)
        await run.recovery.start(resume=False)
        for step in (1, 2, 3):
            await run.step_and_save(step, [f"e0-i{step}"])
            await run.recovery.publish()  # as the loop offers each step's version
        run.weights.failures = 3  # every attempt
        with pytest.raises(AdoptionUnserved, match=r"rollback to step 1 as policy version 4 \(test\): its weights"):
            await run.recovery.rollback(1, reason="test")
        assert run.weights.latest.version == 3  # the abandoned branch's version, still served
        assert (run.progress.step, run.progress.version, run.rewinds) == (1, 4, 1)  # in force, EXPERIENCE re-read
        [held] = run.holds
        assert "could not be served (MemoryError" in held and held.endswith("`rlpipe resume` serves them again")
        assert events_of(run, "rollback") == [] and len(events_of(run, "adoption_unserved")) == 1

        await run.recovery.serve_pending()  # what the loop does once resumed, before its next step
        assert run.weights.latest.version == 4 and run.recovery.unserved is None
        [rolled] = events_of(run, "rollback")
        assert (rolled["step"], rolled["policy_version"], rolled["abandoned_steps"]) == (1, 4, [2, 3])

        run.weights.failures = 1  # once: the retry serves it, and the rollback is done at once
        assert await run.recovery.rollback(1, reason="again") == (1, 5, [])
        assert run.weights.latest.version == 5 and len(run.holds) == 1

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
        assert restarted.lineage.records()[-1].abandoned_steps == [1, 2, 3]
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


def test_groups_applied_by_the_steps_a_rollback_abandons_are_in_flight_again_and_the_events_name_them(
    tiny_model, tmp_path
):
    """Rolled back to a STABLE step older than the purge, the groups steps 2-4 applied lose that fate and their
    EXPERIENCE is gone: they used to be left with no fate at all. They are in flight again (written off as lost
    once overdue, unless they come back), and the events say so."""

    async def scenario() -> None:
        run = Harness(tiny_model, tmp_path, keep_last=2)
        await run.recovery.start(resume=False)
        run.ledger.fed("e0-i5", now=0.0)  # still in the pipeline at the rollback: stays in flight as it was
        await run.step_and_save(1, ["e0-i1"])
        run.checkpoints.mark(1, "STABLE")
        for step in (2, 3, 4):
            await run.step_and_save(step, [f"e0-i{step}"])
        await run.recovery.rollback(None, reason="test")
        assert run.progress.applied_seq == 30  # EXPERIENCE through step 3's sequence is purged
        # The ledger's own watermark stands (step 1's is lower); e0-i2..4 are in flight again below it.
        assert run.ledger.watermark() == "e0-i4" and run.ledger.settled == {}
        serials = {g: f.serial for g, f in run.ledger.in_flight.items()}
        assert serials == {"e0-i5": 1, "e0-i2": 0, "e0-i3": 0, "e0-i4": 0}
        reopened = events_of(run, "groups_reopened_by_rollback")
        assert [(e["step"], e["group_ids"]) for e in reopened] == [(1, ["e0-i2", "e0-i3", "e0-i4"])]

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


def events_of(run: Harness, kind: str) -> list[dict[str, Any]]:
    lines = run.events_path.read_text().splitlines() if run.events_path.exists() else []
    return [event for event in map(json.loads, lines) if event["kind"] == kind]


def test_a_resume_whose_store_cannot_be_reached_waits_then_refuses_having_written_nothing(tiny_model, tmp_path, s3):
    """The issue's case: a run that saved, killed, resumed with its store out of reach. Before, the listing error was
    swallowed and the trainer restarted from base weights, writing a restart into the lineage that abandoned every
    step. Now it waits checkpoint.resume_wait_s, then refuses naming the store and the step it expected; and a store
    that comes back empty (a bucket re-created) is refused the same way: the run's own record says it saved step 2."""

    async def scenario() -> None:
        settings = s3.checkpoint(resume_wait_s=2)
        first = Harness(tiny_model, tmp_path, **settings)
        await first.recovery.start(resume=False)
        for step in (1, 2):
            await first.step_and_save(step, [f"e0-i{step}"])
        lineage_before = first.lineage.text()
        s3.stop()

        restarted = Harness(tiny_model, tmp_path, **settings)
        weights_before = first_weights(restarted.learner)
        with pytest.raises(ResumeRefused, match=r"cannot list the checkpoint store.*step 2 at s3://ckpt/prefix/run/"):
            await restarted.recovery.start(resume=True)
        assert (restarted.progress.step, restarted.progress.version) == (0, 0)
        assert torch.equal(first_weights(restarted.learner), weights_before)
        assert restarted.weights.latest.version == 0 and restarted.rewinds == 0
        assert restarted.lineage.text() == lineage_before
        assert SavedRecord.read(restarted.cfg.run_dir).step == 2

        s3.start()  # moto comes back empty
        again = Harness(tiny_model, tmp_path, **settings)
        claim = lambda: again.checkpoints.claim_fence(2, "host:2")  # noqa: E731  (the lease's, as role.py passes it)
        with pytest.raises(ResumeRefused, match=r"holds no checkpoint of this run, but step 2, which"):
            await again.recovery.start(resume=True, claim=claim)
        assert again.lineage.text() == lineage_before
        assert again.checkpoints.store.list("run/") == []  # nothing was written to the store either, no fence

    asyncio.run(scenario())


def test_a_save_whose_record_cannot_be_written_does_not_count_alerts_and_holds_the_run(tiny_model, tmp_path):
    """Without ``checkpoint-saved.json`` a store emptied later reads as a first start. Before, a failed write of it
    was a warning and the run went on counting the step saved; now the write is retried, then the save does not
    count (a stop now ends unsaved), a ``checkpoint_failed`` row and the ``checkpoint_record_failed`` event alert,
    and the run is held. Once the record can be written, the same step saved again counts."""

    async def scenario() -> None:
        run = Harness(tiny_model, tmp_path)
        await run.recovery.start(resume=False)
        record = run.cfg.run_dir / SavedRecord.FILE
        (record / "in-the-way").mkdir(parents=True)  # a folder where the file goes: replacing it fails
        await run.step_and_save(1, ["e0-i1"])
        assert run.checkpoints.steps() == [1]  # the step itself is stored
        assert run.progress.saved_step == 0
        [held] = run.holds
        assert held.startswith("checkpoint record: step 1 is stored, but") and str(record) in held
        [failed] = [row for row in run.rows if row.get("checkpoint_failed")]
        assert failed["error"] in held and not any(row.get("checkpoint_saved") for row in run.rows)
        [event] = events_of(run, "checkpoint_record_failed")
        assert event["step"] == 1 and event["message"] == held.removeprefix("checkpoint record: ")

        (record / "in-the-way").rmdir()
        record.rmdir()
        await run.recovery.checkpoint_now(config_version=0)  # the operator's `rlpipe checkpoint`, once it is fixed
        assert run.progress.saved_step == 1 and SavedRecord.read(run.cfg.run_dir).step == 1
        assert run.holds == [held]

    asyncio.run(scenario())


def test_a_resume_over_a_damaged_saved_record_is_refused_naming_the_file_and_writes_nothing(
    tiny_model, tmp_path, saved_run
):
    """A torn or hand-edited checkpoint-saved.json is refused (exit 2 in the trainer, never restarted into the same
    file), naming it and what to do; before, the ValueError crashed the trainer with exit 1, and a supervisor
    restarted it into the same file."""

    async def scenario() -> None:
        restarted = Harness(tiny_model, tmp_path)
        record = restarted.cfg.run_dir / SavedRecord.FILE
        record.write_text('{"step": 3, "policy_ver')
        lineage_before = restarted.lineage.text()
        with pytest.raises(ResumeRefused, match=r"checkpoint-saved.json is not a checkpoint record .*move it away"):
            await restarted.recovery.start(resume=True)
        assert (restarted.progress.step, restarted.progress.version) == (0, 0)
        assert restarted.lineage.text() == lineage_before and restarted.rewinds == 0

    asyncio.run(scenario())


def test_a_store_that_comes_back_within_the_wait_is_resumed_from_and_the_lineage_gains_only_the_resume(
    tiny_model, tmp_path, saved_run
):
    """The store's run folder cannot be read for a while (a folder that errors when listed, as a stale mount does);
    before, the listing skipped it as empty and the trainer restarted from base weights. The run's own record of its
    saves is gone too (a new node), so the store's answer alone must say "unreadable", not "empty"."""
    SavedRecord.clear(tmp_path / "runs" / "test")
    run_folder = tmp_path / "store" / "run"
    run_folder.rename(tmp_path / "store" / "run.away")
    run_folder.write_text("not a folder")

    async def store_back_after(seconds: float) -> None:
        await asyncio.sleep(seconds)
        run_folder.unlink()
        (tmp_path / "store" / "run.away").rename(run_folder)

    async def scenario() -> None:
        restarted = Harness(tiny_model, tmp_path, resume_wait_s=60)
        records_before = restarted.lineage.records()
        back = asyncio.create_task(store_back_after(2.0))
        assert await restarted.recovery.start(resume=True)
        await back
        assert (restarted.progress.step, restarted.progress.version, restarted.progress.applied_seq) == (3, 4, 30)
        records = restarted.lineage.records()
        assert records[: len(records_before)] == records_before
        assert [(r.event, r.from_step, r.abandoned_steps) for r in records[len(records_before) :]] == [
            ("resume", 3, [])
        ]

    asyncio.run(scenario())


def test_a_corrupt_newest_step_falls_back_to_the_previous_one_and_says_so_in_the_events(
    tiny_model, tmp_path, saved_run
):
    with (tmp_path / "store" / "run" / "step-00000003" / "model.safetensors").open("ab") as part:
        part.write(b"bitrot")

    async def scenario() -> None:
        restarted = Harness(tiny_model, tmp_path)
        assert await restarted.recovery.start(resume=True)
        assert torch.equal(first_weights(restarted.learner), saved_run)
        # Step 3's manifest still says version 3 was served: the new one is past it.
        assert (restarted.progress.step, restarted.progress.version) == (2, 4)
        [fallback] = events_of(restarted, "checkpoint_fallback")
        assert fallback["step"] == 2 and fallback["skipped_steps"] == [3]
        assert "model.safetensors does not match its manifest hash" in fallback["message"]

    asyncio.run(scenario())


def test_a_step_in_a_newer_checkpoint_format_is_refused_by_name_and_not_skipped(tiny_model, tmp_path, saved_run):
    """Skipping it for step 2 would abandon step 3's training because this rlpipe is older than the one that
    wrote it."""
    manifest_path = tmp_path / "store" / "run" / "step-00000003" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["format"] == FULL_FORMAT  # a full save is written in the oldest format that holds it
    manifest_path.write_text(json.dumps({**manifest, "format": 99}))

    async def scenario() -> None:
        restarted = Harness(tiny_model, tmp_path)
        lineage_before = restarted.lineage.text()
        with pytest.raises(UnknownCheckpointFormat, match=r"step 3 at .* is in checkpoint format 99, written by"):
            await restarted.recovery.start(resume=True)
        assert restarted.lineage.text() == lineage_before
        assert restarted.checkpoints.steps() == [1, 2, 3]
        assert (restarted.progress.step, restarted.progress.version) == (0, 0)

    asyncio.run(scenario())


def test_a_lineage_that_lost_its_tail_still_serves_a_version_past_every_stored_step(tiny_model, tmp_path, saved_run):
    """A node crash took lineage.jsonl's last records (steps 2 and 3, versions 2 and 3). A resume to step 2 once
    served version 3 again, which rollouts holding step 3's weights as version 3 would never pull."""
    lineage_path = tmp_path / "runs" / "lineage.jsonl"
    lineage_path.write_text(lineage_path.read_text().splitlines(keepends=True)[0])

    async def scenario() -> None:
        restarted = Harness(tiny_model, tmp_path, resume_step=2)
        assert await restarted.recovery.start(resume=True)
        assert (restarted.progress.step, restarted.progress.version) == (2, 4)
        assert restarted.weights.latest.version == 4

    asyncio.run(scenario())


def test_a_resume_on_another_machine_disowns_the_versions_served_after_the_newest_checkpoint(
    tiny_model, tmp_path, nats_url
):
    """Step 1 saved as version 1, then versions 2 and 3 served and never saved, and the machine lost with its run
    folder: its lineage knew 2 and 3, the checkpoint does not. The broker's served-version mark does, so the resume
    serves version 4 and drops the groups versions 2 and 3 generated, as it would on the same machine."""

    async def scenario() -> None:
        nc = await nats.connect(nats_url)
        kv = await open_lease_bucket(nc.jetstream(), "run", "memory", 1)
        first = Harness(tiny_model, tmp_path, served=ServedVersions(kv))
        assert not await first.recovery.start(resume=False)
        await first.step_and_save(1, ["e0-i1"])
        for version in (2, 3):
            await first.recovery.publisher.publish(version, step=1)
        assert first.weights.latest.version == 3
        shutil.rmtree(tmp_path / "runs")

        elsewhere = Harness(tiny_model, tmp_path, served=ServedVersions(kv))
        assert await elsewhere.recovery.start(resume=True)
        assert (elsewhere.progress.step, elsewhere.progress.version) == (1, 4)
        assert elsewhere.progress.abandoned_versions == [(2, 3)]
        assert elsewhere.weights.latest.version == 4
        # A trainer that starts later never writes the mark below what an earlier one recorded.
        late = ServedVersions(kv)
        await late.raise_to(2)
        assert await ServedVersions(kv).read() == 4
        await nc.close()

    asyncio.run(scenario())


def test_a_resume_to_a_named_step_is_made_once_and_a_later_restart_takes_the_newest_step(
    tiny_model, tmp_path, saved_run
):
    async def scenario() -> None:
        second = Harness(tiny_model, tmp_path, resume_step=2)
        assert await second.recovery.start(resume=True)
        assert (second.progress.step, second.progress.version) == (2, 4)
        second.progress.step, second.progress.version, second.progress.applied_seq = 3, 5, 35
        second.ledger.settle(["e0-i5"], 3, Fate.APPLIED)
        second.lineage.record_step(3, 5, [("e0-i5", 4)], [], 35)
        await second.recovery.save(config_version=0, wait=True)

        # The launcher restarts the trainer with the same config, resume_step still 2.
        third = Harness(tiny_model, tmp_path, resume_step=2)
        assert await third.recovery.start(resume=True)
        assert (third.progress.step, third.progress.version, third.progress.applied_seq) == (3, 6, 35)
        assert third.lineage.records()[-1].from_step == 3

    asyncio.run(scenario())


def test_a_requested_resume_made_before_the_run_folder_was_lost_is_not_made_again(tiny_model, tmp_path, saved_run):
    """The run folder (lineage.jsonl with it) is gone, as on a new machine: the stored steps' lineage still records
    the requested resume, so the restart takes the newest step instead of abandoning everything after step 1."""

    async def scenario() -> None:
        second = Harness(tiny_model, tmp_path, resume_step=1)
        assert await second.recovery.start(resume=True)
        assert second.progress.step == 1
        second.progress.step, second.progress.version, second.progress.applied_seq = 3, 6, 35
        second.ledger.settle(["e0-i5"], 3, Fate.APPLIED)
        second.lineage.record_step(3, 6, [("e0-i5", 5)], [], 35)
        await second.recovery.save(config_version=0, wait=True)
        shutil.rmtree(tmp_path / "runs")

        third = Harness(tiny_model, tmp_path, resume_step=1)
        assert await third.recovery.start(resume=True)
        assert (third.progress.step, third.progress.applied_seq) == (3, 35)
        assert [entry.step for entry in third.checkpoints.catalog() if entry.abandoned] == []
        assert third.checkpoints.steps() == [1, 3]

    asyncio.run(scenario())


def test_a_requested_step_that_is_not_stored_refuses_the_start_by_name_and_writes_nothing(
    tiny_model, tmp_path, saved_run
):
    """A crash (exit 1) would have the launcher restart it into the same missing step, over and over."""
    store = tmp_path / "store"
    before = sorted(str(path.relative_to(store)) for path in store.rglob("*"))

    async def scenario() -> None:
        restarted = Harness(tiny_model, tmp_path, resume_step=7)
        with pytest.raises(
            ResumeRefused, match=r"checkpoint\.resume_step 7: no step 7 is stored .* \(stored: \[1, 2, 3\]\)"
        ):
            await restarted.recovery.start(resume=True, claim=lambda: restarted.checkpoints.claim_fence(1, "h:1"))

    asyncio.run(scenario())
    assert sorted(str(path.relative_to(store)) for path in store.rglob("*")) == before


@pytest.mark.parametrize("spoil", ["shape", "nan"])
def test_a_rollback_to_a_checkpoint_that_does_not_fit_changes_nothing(tiny_model, tmp_path, spoil):
    """Before, the later steps were marked abandoned first, and the weights that fitted were copied before the
    misfit raised (or the NaN was loaded): training went on with mixed weights."""

    async def scenario() -> None:
        run = Harness(tiny_model, tmp_path)
        await run.recovery.start(resume=False)
        for step in (1, 2, 3):
            await run.step_and_save(step, [f"e0-i{step}"])
        ckpt = run.checkpoints.load(1)
        name = sorted(ckpt.model)[len(ckpt.model) // 2]
        if spoil == "shape":
            ckpt.model[name] = ckpt.model[name].flatten()[:-1]
        else:
            ckpt.model[name] = ckpt.model[name].clone().fill_(float("nan"))
        weights_before = {k: v.clone() for k, v in run.learner.model.state_dict().items()}
        progress_before = dataclasses.replace(run.progress, abandoned_versions=list(run.progress.abandoned_versions))
        lineage_before = run.lineage.text()
        served_before = run.weights.latest

        with pytest.raises(CheckpointMismatch, match=f"step 1's weights does not fit the model: {re.escape(name)}"):
            await run.recovery.adopt(ckpt, "rollback", reason="test")
        assert all(torch.equal(run.learner.model.state_dict()[k], v) for k, v in weights_before.items())
        assert run.progress == progress_before
        assert run.checkpoints.steps() == [1, 2, 3]  # nothing marked abandoned
        assert run.lineage.text() == lineage_before
        assert run.weights.latest is served_before and run.rewinds == 0

    asyncio.run(scenario())


class FarStore(FileStore):
    """A file store whose every write takes a while, as an object store across a slow link does."""

    def put(self, key: str, data: bytes, tags: Mapping[str, str] | None = None) -> None:
        time.sleep(0.2)
        super().put(key, data, tags)


def test_steps_go_on_while_a_periodic_save_uploads_and_the_save_holds_the_weights_of_its_own_step(tiny_model, tmp_path):
    async def scenario() -> None:
        run = Harness(tiny_model, tmp_path, store=FarStore(tmp_path / "store"), save_every_steps=1)
        assert not await run.recovery.start(resume=False)
        await run.step_and_save(1, ["e0-i1"], final=False)
        with torch.no_grad():
            next(run.learner.model.parameters()).add_(1.0)
        run.progress.step, run.progress.version = 2, 2
        at_two = first_weights(run.learner)
        took = Stopwatch()
        await run.recovery.save(config_version=0)  # periodic: the snapshot only, the upload in the background
        held_s = took()
        # The loop is free while the upload (a dozen writes of 0.2 s each) goes on: three more steps change the
        # weights in the meantime.
        assert run.recovery.upload is not None and not run.recovery.upload.done()
        for step in (3, 4, 5):
            with torch.no_grad():
                next(run.learner.model.parameters()).add_(1.0)
            run.progress.step = step
            await asyncio.sleep(0)
        assert not run.recovery.upload.done()
        await run.recovery.wait_for_upload()
        *_, row = [row for row in run.rows if row.get("checkpoint_saved")]
        assert row["step"] == 5  # reported once stored, at the step the loop had reached
        assert held_s < row["checkpoint_time_s"] / 5 and row["checkpoint_stall_s"] <= held_s
        # What was stored is step 2 as it was when the save was asked for, not the weights the loop moved on to.
        name, live = next(iter(run.learner.model.named_parameters()))
        assert torch.equal(run.checkpoints.load(2).model[name], at_two) and not torch.equal(live, at_two)

    asyncio.run(scenario())


def test_a_rollback_to_a_save_without_optimizer_state_starts_adamw_fresh_says_so_and_each_save_reports_its_stall(
    tiny_model, tmp_path
):
    """checkpoint.optimizer_every: 2 with a save every step: the periodic save of step 1 holds no optimizer state,
    step 2's does. Going back to step 2 loads its moments; going back to step 1 drops them and writes
    optimizer_fresh."""

    async def scenario() -> None:
        run = Harness(tiny_model, tmp_path, save_every_steps=1, optimizer_every=2)
        assert not await run.recovery.start(resume=False)
        for param in run.learner.parameters():  # moments in the optimizer: what a fresh start must not keep
            param.grad = torch.ones_like(param)
        run.learner.optimizer.step()
        for step in (1, 2):
            await run.step_and_save(step, [f"e0-i{step}"], final=False)
        files = {
            step: json.loads((tmp_path / "store" / "run" / f"step-{step:08d}" / "manifest.json").read_text())["files"]
            for step in (1, 2)
        }
        assert ("optimizer.pt" in files[1], "optimizer.pt" in files[2]) == (False, True)
        saved = [row for row in run.rows if row.get("checkpoint_saved")]
        assert [row["step"] for row in saved] == [1, 2]
        assert all(row["checkpoint_stall_s"] > 0 for row in saved)

        await run.recovery.rollback(2, "test")  # a save that kept the moments brings them back
        assert len(run.learner.optimizer.state) == len(run.learner.parameters())
        await run.recovery.rollback(1, "test")
        assert len(run.learner.optimizer.state) == 0
        events = [json.loads(line) for line in run.events_path.read_text().splitlines()]
        assert [event["step"] for event in events if event["kind"] == "optimizer_fresh"] == [1]

    asyncio.run(scenario())


def test_a_save_at_a_stop_or_on_request_of_a_step_saved_without_optimizer_state_stores_it(tiny_model, tmp_path):
    """checkpoint.optimizer_every: 2 with a save every step: step 1's periodic save holds no optimizer state, and
    the saves that the config promises always keep it (at a stop, on request) kept the stored copy without it."""

    async def scenario() -> None:
        run = Harness(tiny_model, tmp_path, save_every_steps=1, optimizer_every=2)
        assert not await run.recovery.start(resume=False)
        for param in run.learner.parameters():
            param.grad = torch.ones_like(param)
        run.learner.optimizer.step()
        await run.step_and_save(1, ["e0-i1"], final=False)
        assert run.checkpoints.load(1).optimizer is None
        entry = await run.recovery.checkpoint_now(config_version=0)  # `rlpipe checkpoint`
        assert entry is not None and entry.step == 1
        assert run.checkpoints.load(1).optimizer is not None
        assert run.progress.saved_in_full

        # A stop while the periodic save of the same step still uploads: the stop's save waits for it, then saves.
        with torch.no_grad():
            next(run.learner.model.parameters()).add_(1.0)
        run.progress.step, run.progress.version, run.progress.applied_seq = 3, 3, 30
        run.lineage.record_step(3, 3, [("e0-i3", 2)], [], 30)
        await run.recovery.save(config_version=0)  # periodic, in the background: step 3 keeps no optimizer state
        await run.recovery.save(config_version=0, wait=True)
        assert run.checkpoints.load(3).optimizer is not None

    asyncio.run(scenario())
