"""Recovery: checkpoints in, checkpoints out.

Saving takes a copy of everything a step depends on between steps and uploads it in the
background while training goes on; after a save, the EXPERIENCE (and claim-checked
bodies) that no kept checkpoint would re-read are purged, and the ledger forgets the fates
settled before the oldest kept step that its watermark refuses for them. The watermark is
saved in the same checkpoint as the weights and adopted with them.

Resume and rollback are one operation, ``adopt``: serve a stored step as a new policy
version. It is all-or-nothing in this order: the checkpoint is read and checked whole
against the model (keys, shapes, dtypes, finite values: nothing is copied before), the
store is changed (every later step marked ABANDONED, which is idempotent, so a failure
here changes nothing in memory and the same call can be made again), and only then is the
running state replaced, the lineage written, the weights published and EXPERIENCE re-read
from the step's sequence. Policy versions only grow across restarts: the versions that the
abandoned steps produced are disowned, and groups they generated are dropped on arrival.

A resume never takes an unreadable store for an empty one (``services/trainer/resume.py``): it
waits up to ``checkpoint.resume_wait_s`` for the store, and then refuses to start, having
written nothing to the lineage or the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import yaml

from services.common.config import BuildInfo, redacted_dump
from services.common.observe.events import EventLog
from services.common.observe.logs import Stopwatch, log_event
from services.common.observe.telemetry import TrainerMetrics
from services.common.transport.bus import Bus
from services.common.transport.streams import EXPERIENCE, stream_name
from services.common.transport.weightsync.server import WeightSyncServer
from services.trainer.checkpoint import (
    STABLE,
    UNREADABLE,
    Checkpoint,
    CheckpointCorrupt,
    CheckpointStore,
    ForeignCheckpoints,
    Resumable,
    TrainerState,
    UnknownCheckpointFormat,
    new_incarnation,
)
from services.trainer.intake import GroupLedger, PromptFeeder
from services.trainer.learner import Learner
from services.trainer.lineage import Lineage, settled_after
from services.trainer.progress import ConfigSource, Progress
from services.trainer.resume import ResumeBlocked, SavedRecord, StoreUnreadable

log = logging.getLogger(__name__)
RESUME_RETRY_MAX_S = 30.0  # the longest pause between two looks at an unreadable store


class ResumeRefused(RuntimeError):
    """The checkpoint a resume needs stayed unreadable for ``checkpoint.resume_wait_s``: the trainer does not start."""


class Recovery:
    def __init__(
        self,
        settings: ConfigSource,
        learner: Learner,
        checkpoints: CheckpointStore,
        lineage: Lineage,
        progress: Progress,
        ledger: GroupLedger,
        feeder: PromptFeeder,
        weights: WeightSyncServer,
        bus: Bus,
        events: EventLog,
        telemetry: TrainerMetrics,
        report: Callable[[dict[str, Any]], Awaitable[None]],
        rewind: Callable[[], None],
    ):
        self.settings = settings
        self.learner = learner
        self.checkpoints = checkpoints
        self.lineage = lineage
        self.progress = progress
        self.ledger = ledger
        self.feeder = feeder
        self.weights = weights
        self.bus = bus
        self.events = events
        self.telemetry = telemetry
        self.report = report  # a metrics row about a save: written and judged by the alert rules
        self.rewind = rewind  # re-read EXPERIENCE after progress.applied_seq
        self.build = BuildInfo().resolved()
        self.upload: asyncio.Task | None = None
        self.claim_keys: dict[str, int] = {}  # claim-checked EXPERIENCE bodies read, key -> sequence
        self.purged_seq = 0  # EXPERIENCE purged through here by this process

    # -- start ------------------------------------------------------------------------

    async def start(self, resume: bool) -> bool:
        """Adopt the configured or newest checkpoint when resuming; returns whether one was adopted.

        A fresh start refuses a store that already holds steps of this run id (another run's, or this
        one's from before): it would prune, purge and later resume from them. A resume whose store cannot be
        read waits for it, then raises ResumeRefused; nothing is written before the checkpoint is in hand."""
        run_dir = self.settings.cfg.run_dir
        if not resume:
            self.progress.incarnation = await asyncio.to_thread(self.checkpoints.start_fresh)
            SavedRecord.clear(run_dir)  # an earlier run's record under this run id is not this run's
            return False
        saved = SavedRecord.read(run_dir)
        wanted = self.settings.cfg.checkpoint.resume_step
        if wanted is not None and self.lineage.resumed_to(wanted):
            # Made already: a restart after it continues from the newest step, not from the requested one again.
            log_event(log, "resume_step_done", step=wanted)
            wanted = None
        found = await self._find_checkpoint(saved, wanted)
        if found.checkpoint is None:
            await self._restart_without_checkpoint()
            return False
        ckpt = found.checkpoint
        await self.adopt(ckpt, "resume", reason="trainer start", requested=wanted is not None)
        passed_over = sorted(found.skipped) or ([saved.step] if saved is not None and saved.step > ckpt.step else [])
        if passed_over and wanted is None:
            why = "; ".join(found.skipped.values()) or "no longer stored"
            message = f"resumed from step {ckpt.step}, not from newer step(s) {passed_over}: {why}"
            self.events.write("checkpoint_fallback", message, step=ckpt.step, skipped_steps=passed_over)
            log_event(log, "checkpoint_fallback", level=logging.WARNING, alert=True, step=ckpt.step, reason=message)
        return True

    async def _find_checkpoint(self, saved: SavedRecord | None, wanted: int | None) -> Resumable:
        """The checkpoint to resume from (``wanted``, or the newest), waiting for a store that cannot be read."""
        bound = self.settings.cfg.checkpoint.resume_wait_s
        started = time.monotonic()
        delay = 1.0
        while True:
            try:
                if wanted is not None:
                    return Resumable(await asyncio.to_thread(self._load_requested, wanted))
                return await asyncio.to_thread(self.checkpoints.load_newest, saved.step if saved else None)
            except ResumeBlocked as error:
                waited = time.monotonic() - started
                if waited + delay > bound:
                    record = f"; this run last saved step {saved.step} at {saved.location}" if saved else ""
                    raise ResumeRefused(
                        f"not resuming from {self.checkpoints.location()}: {error}{record}. Waited {waited:.0f} s "
                        f"(checkpoint.resume_wait_s: {bound:g}); nothing was written. Bring the store back and "
                        "start the run again; starting it without --resume abandons its training."
                    ) from error
                log_event(
                    log,
                    "resume_waiting",
                    level=logging.ERROR,
                    alert=True,
                    store=self.checkpoints.location(),
                    error=str(error)[:500],
                    waited_s=round(waited, 1),
                    retry_s=delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESUME_RETRY_MAX_S)

    def _load_requested(self, step: int) -> Checkpoint:
        """Step ``step`` (``checkpoint.resume_step``); a store that fails to answer is waited for, not a refusal."""
        try:
            return self.checkpoints.load(step)
        except (CheckpointCorrupt, FileNotFoundError, UnknownCheckpointFormat, ForeignCheckpoints):
            raise
        except Exception as error:  # the store's many failure types
            raise StoreUnreadable(f"cannot read step {step}: {error!r}"[:500]) from error

    async def _restart_without_checkpoint(self) -> None:
        """A restart before the run's first checkpoint: a new incarnation, whose policy versions still grow past
        any this run served (rollouts may hold them), and which abandons the steps taken before."""
        self.progress.incarnation = self.checkpoints.incarnation = new_incarnation()
        self.progress.applied_seq = await self.read_on_after(0)
        served = self.lineage.max_version()
        if served:
            self.progress.version = served + 1
            self.lineage.restart_from(0, self.progress.version, "restart", abandoned_versions=(1, served))
            self.progress.abandoned_versions = self.lineage.abandoned_versions()
            await self.publish()

    # -- adopt: resume and rollback -----------------------------------------------------

    async def adopt(self, ckpt: Checkpoint, event: str, reason: str, requested: bool = False) -> list[int]:
        """Serve stored step ``ckpt.step`` as a new policy version; returns the steps this abandons.

        ``requested``: a resume to the step named by ``checkpoint.resume_step`` (recorded, so it is made once)."""
        # Staging: the checkpoint must fit the model whole before the store or the running state changes.
        await asyncio.to_thread(self.learner.check, ckpt)
        # The store learns whose steps it keeps first (setting it again on a retry is harmless), so that
        # marking later steps abandoned, which may fail and leaves memory untouched, spares other runs' steps.
        incarnation = self.checkpoints.adopt_incarnation(ckpt)
        stored_high_water = await asyncio.to_thread(self.checkpoints.version_high_water)
        later = await asyncio.to_thread(self.checkpoints.abandon_after, ckpt.step)
        state: TrainerState = ckpt.state
        read_from = await self.read_on_after(state.last_experience_seq)
        progress = self.progress
        # Versions only grow: past any this run served, by what the lineage, this checkpoint and every stored step
        # say (a lineage.jsonl that lost its tail in a node crash is covered by the checkpoints).
        served = max(progress.version, self.lineage.max_version(), state.policy_version, state.version_high_water)
        new_version = max(served, stored_high_water) + 1
        disowned = (state.policy_version + 1, new_version - 1)
        self.learner.load(ckpt)
        self.learner.reconfigure(self.settings.cfg)  # the live hyperparameters stay in force
        progress.step = progress.saved_step = ckpt.step
        progress.version = new_version
        progress.applied_seq = read_from
        if event == "resume":  # a rollback keeps reading DEAD where it is: dead letters are facts about the pipeline
            progress.dead_seq = state.dead_seq
        progress.last_eval = state.eval_accuracy
        progress.incarnation = incarnation
        self.claim_keys |= {key: seq for seq, key in state.claim_keys}
        if event == "resume":
            # A new process: the cursor, the in-flight groups and what the lineage settled are the checkpoint's.
            self.feeder.seek(state.data_cursor)
            self.ledger.restore(
                state.in_flight,
                state.applied_ids,
                state.dead_ids,
                state.reinjected,
                ckpt.step,
                time.monotonic(),
                state.settled_through,
            )
            progress.baseline_eval = state.baseline_accuracy
            progress.last_row = dict(state.metrics)
        else:
            # The same process goes back: prompts already fed stay in flight and are not fed again.
            abandoned_groups = settled_after(await asyncio.to_thread(self.lineage.records), ckpt.step)
            undone = self.ledger.rewind(
                state.applied_ids, ckpt.step, time.monotonic(), state.settled_through, abandoned_groups
            )
            if undone:
                message = f"{len(undone)} group(s) the abandoned steps had settled are in flight again"
                self.events.write(
                    "groups_reopened_by_rollback", message, step=ckpt.step, count=len(undone), group_ids=undone[:50]
                )
                log_event(log, "groups_reopened_by_rollback", step=ckpt.step, count=len(undone), group_ids=undone[:20])
        abandoned = self.lineage.restart_from(
            ckpt.step,
            new_version,
            event,
            copy_if_missing=ckpt.lineage,
            abandoned_versions=disowned if disowned[1] >= disowned[0] else None,
            requested=requested,
        )
        progress.abandoned_versions = self.lineage.abandoned_versions()
        # The newest live step is now this one: a later resume expects it (or a newer one saved after).
        await asyncio.to_thread(self._record_saved, ckpt.step)
        await self.publish()
        self.rewind()
        message = f"{event} to step {ckpt.step} as policy version {new_version} ({reason})"
        self.events.write(
            event, message, step=ckpt.step, policy_version=new_version, abandoned_steps=abandoned, reason=reason
        )
        log_event(
            log,
            "resumed" if event == "resume" else "rolled_back",
            step=ckpt.step,
            policy_version=new_version,
            experience_seq=progress.applied_seq,
            abandoned_steps=abandoned,
            abandoned_checkpoints=later,
            reason=reason,
        )
        return abandoned

    def _record_saved(self, step: int) -> None:
        """Note, fsynced in the run folder, that ``step`` is the newest live step stored (``SavedRecord``)."""
        SavedRecord(
            step=step,
            policy_version=max(self.progress.version, self.lineage.max_version()),
            incarnation=self.progress.incarnation,
            location=f"{self.checkpoints.location()}step-{step:08d}/",
        ).write(self.settings.cfg.run_dir)

    async def read_on_after(self, seq: int) -> int:
        """Where to read EXPERIENCE on from for a state that read through ``seq``: there, or past this run's purge
        when it went further (a rollback to a STABLE step older than the kept window, a resume after checkpoints
        were off). The groups in between are gone on purpose; those the state still had in flight are written off
        as lost once overdue (``train.lost_after_s``), like any group that never comes back."""
        created = await self.bus.stream_created(EXPERIENCE)
        purged = await asyncio.to_thread(self.checkpoints.purged_through, str(created))
        if purged <= seq:
            return seq
        log_event(log, "replay_purged", level=logging.WARNING, read_through=seq, purged_through=purged)
        return purged

    async def rollback(self, step: int | None, reason: str) -> tuple[int, int, list[int]]:
        """Serve checkpoint ``step`` (None: the newest stable one) as a new policy version.

        The steps after it are abandoned, and so are the policy versions they produced: groups
        those versions generated are dropped when they arrive. EXPERIENCE is re-read from the
        checkpoint's sequence, so the groups the abandoned steps trained on are applied again (or
        dropped, if an abandoned version made them): each group is still accounted for exactly once
        in the steps that make up the model.
        """
        await self.wait_for_upload()  # a save of the state being abandoned must land before it is marked
        stored = await asyncio.to_thread(self.checkpoints.steps)
        if step is None:
            step = await asyncio.to_thread(self.checkpoints.latest_stable)
            if step is None:
                raise LookupError("no checkpoint is marked stable (rlpipe mark-stable STEP)")
        elif step not in stored:
            raise LookupError(f"no stored checkpoint at step {step} (stored: {stored})")
        try:
            ckpt = await asyncio.to_thread(self.checkpoints.load, step)
        except UNREADABLE as error:
            raise CheckpointCorrupt(
                f"the checkpoint of step {step} cannot be loaded ({error}); nothing was changed"
            ) from error
        abandoned = await self.adopt(ckpt, "rollback", reason)
        return step, self.progress.version, abandoned

    async def publish(self) -> None:
        """Serve the learner's weights as the current policy version."""
        await self.weights.publish(self.learner.snapshot(self.progress.version, self.progress.step))

    # -- save ---------------------------------------------------------------------------

    def snapshot(self, config_version: int) -> Checkpoint:
        """A copy of everything to save, taken between steps so the upload can run while training goes on."""
        cfg, progress, learner = self.settings.cfg, self.progress, self.learner
        self.ledger.advance()  # the newest watermark, so the checkpoint lists as few groups beside it as it can
        state = learner.state()  # in host memory and one process's format, whatever the world size
        return Checkpoint(
            step=progress.step,
            model=state.model,
            optimizer=state.optimizer,
            scheduler=learner.scheduler.state_dict(),
            rng=learner.rng_state(),
            critic=state.critic,
            lineage=self.lineage.text(),
            state=TrainerState(
                step=progress.step,
                policy_version=progress.version,
                config_version=config_version,
                data_cursor=self.feeder.cursor,
                last_experience_seq=progress.applied_seq,
                in_flight=self.ledger.unsettled(),
                eval_accuracy=progress.last_eval,
                baseline_accuracy=progress.baseline_eval,
                metrics=dict(progress.last_row),
                incarnation=progress.incarnation,
                settled_through=self.ledger.watermark(),
                applied_ids=self.ledger.exceptions(),
                dead_ids=self.ledger.dead(),
                dead_seq=progress.dead_seq,
                reinjected=sorted(self.ledger.reinjected),
                claim_keys=sorted((seq, key) for key, seq in self.claim_keys.items()),
                version_high_water=max(progress.version, self.lineage.max_version()),
                base_model_path=learner.base_model[0],
                base_model_sha256=learner.base_model[1],
            ),
            extras={
                # What produced these weights, for whoever restores or audits them.
                "config.yaml": yaml.safe_dump(redacted_dump(cfg), sort_keys=False).encode(),
                "build.json": json.dumps({"version": self.build.version, "revision": self.build.revision}).encode(),
            },
        )

    def track_claims(self, claim_keys: list[tuple[int, str]]) -> None:
        self.claim_keys |= {key: seq for seq, key in claim_keys}

    async def wait_for_upload(self) -> None:
        if self.upload is not None and not self.upload.done():
            await self.upload

    async def save(self, config_version: int, wait: bool = False) -> None:
        """Checkpoint in the background; with ``wait``, until it is stored (or has failed)."""
        if self.upload is not None and not self.upload.done():
            if not wait:
                log_event(
                    log,
                    "checkpoint_deferred",
                    level=logging.WARNING,
                    step=self.progress.step,
                    reason="previous upload still running",
                )
                return
            await self.upload
            if self.progress.saved_step == self.progress.step:
                return  # that upload was this very step
        self.upload = asyncio.create_task(self._upload(self.snapshot(config_version)))
        if wait:
            await self.upload

    async def _upload(self, ckpt: Checkpoint) -> None:
        took = Stopwatch()
        try:
            location = await asyncio.to_thread(self.checkpoints.save, ckpt, self.settings.cfg.model.path)
        except Exception as error:  # the store's many failure types; training must go on
            self.telemetry.record_checkpoint(took(), ok=False)
            log_event(
                log, "checkpoint_failed", level=logging.ERROR, alert=True, step=ckpt.step, error=repr(error)[:500]
            )
            # The row carries the current step: the save's own step may be behind, and is not one to roll back to.
            await self.report({"step": self.progress.step, "checkpoint_failed": 1, "error": repr(error)[:500]})
            return
        seconds = took()
        self.telemetry.record_checkpoint(seconds, ok=True)
        self.progress.saved_step = max(self.progress.saved_step, ckpt.step)
        try:
            await asyncio.to_thread(self._record_saved, self.progress.saved_step)
        except OSError as error:  # the step is stored; a resume finds it by listing, the record is a second witness
            log_event(log, "checkpoint_record_failed", level=logging.WARNING, step=ckpt.step, error=repr(error)[:300])
        # checkpoint_failed 0 clears a checkpoint-failure alert that an earlier save raised.
        await self.report(
            {"step": self.progress.step, "checkpoint_saved": 1, "checkpoint_failed": 0, "checkpoint_time_s": seconds}
        )
        log_event(log, "checkpoint", step=ckpt.step, location=location, save_s=seconds)
        await self.purge_consumed()

    async def purge_consumed(self) -> None:
        """Drop what no kept checkpoint would re-read: EXPERIENCE, its claim-checked bodies, settled group ids.

        With ``checkpoint.save_every_steps: 0`` that is everything read: a resume from a checkpoint saved at a stop
        reads on from the purge rather than keeping the stream since then. The purge is recorded (``record_purge``)
        before it is made, so a reader finding the stream purged knows it from a broker that lost messages."""
        read_seq = self.progress.applied_seq
        try:
            if self.settings.cfg.checkpoint.save_every_steps:
                floor = await asyncio.to_thread(self.checkpoints.replay_floor, read_seq)
            else:
                floor = read_seq
            if floor is None or floor <= self.purged_seq:
                return
            created = await self.bus.stream_created(EXPERIENCE)
            await asyncio.to_thread(self.checkpoints.record_purge, floor, str(created))
            await self.bus.js.purge_stream(stream_name(self.bus.run_id, EXPERIENCE), seq=floor + 1)
            doomed = [key for key, seq in self.claim_keys.items() if seq <= floor]
            await asyncio.to_thread(self.bus.claims.delete, doomed)
            oldest = min(await asyncio.to_thread(self.checkpoints.steps), default=None)
        except Exception as error:  # the broker's or the store's failures; purging can wait for the next save
            log_event(log, "purge_failed", level=logging.WARNING, error=repr(error)[:300])
            return
        self.purged_seq = floor
        for key in doomed:
            self.claim_keys.pop(key, None)
        if oldest is not None:
            self.ledger.forget_through(oldest)
        log_event(log, "purged", experience_below=floor + 1, claims=len(doomed))

    # -- operator calls -------------------------------------------------------------

    async def catalog(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.checkpoints.catalog)

    async def entry(self, step: int) -> dict[str, Any] | None:
        return next((e for e in await self.catalog() if e["step"] == step), None)

    async def checkpoint_now(self, config_version: int) -> dict[str, Any] | None:
        """Store the current step (unless it already is) and describe it; None if the save failed."""
        step = self.progress.step
        if self.progress.saved_step != step or step not in await asyncio.to_thread(self.checkpoints.steps):
            await self.save(config_version, wait=True)
        return await self.entry(step)

    async def mark_stable(self, step: int) -> dict[str, Any] | None:
        """Run between steps: never beside a save of the same step, which rewrites its folder."""
        await self.wait_for_upload()
        await asyncio.to_thread(self.checkpoints.mark, step, STABLE)
        log_event(log, "marked_stable", step=step)
        return await self.entry(step)
