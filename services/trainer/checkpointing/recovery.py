"""Recovery: checkpoints in, checkpoints out, in the order the trainer needs them.

It wires three single-purpose parts and orders their effects, so that the order is read in one place:

- ``checkpointer.py`` takes a copy of everything a step depends on between steps, and stores it;
- ``retention.py`` decides which stored steps stay and purges what no kept step would read again;
- ``adopter.py`` finds, checks and adopts a stored step, for a resume and for a rollback.

A save snapshots between steps and uploads in the background while training goes on; once the step is stored the
run's own record (``resume.SavedRecord``) names it, a metrics row reports it, and what no kept checkpoint would
re-read is purged. An adoption (resume or rollback, ``adopt``) is put in force after the adopter changed the store,
the learner, the ledger and the lineage: the progress is replaced, EXPERIENCE is re-read from its sequence, the
record names the adopted step, and its weights are served as a new policy version. Only then is it done (its event
emitted): weights that cannot be served are offered again, and if they still cannot be the rollouts would go on
with the abandoned branch's, so a rollback holds the run (``AdoptionUnserved``) and the loop serves them before its
next step once an operator resumes it.

Publishing is ``Publisher``'s (services/trainer/publisher.py), in the background after a step and awaited after an
adoption; a save's snapshot and an adoption first wait until the newest version's copy was taken, since they read
or change the learner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from services.common.config import BuildInfo
from services.common.observe.events import Event, Journal
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.logs import Stopwatch, log_event
from services.common.transport.bus import Bus
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import NonFiniteWeights
from services.trainer.checkpointing.adopter import Adopter, ResumeRefused
from services.trainer.checkpointing.checkpointer import Checkpointer
from services.trainer.checkpointing.lineage import Lineage
from services.trainer.checkpointing.manifest import STABLE, CatalogEntry
from services.trainer.checkpointing.restorable import Restorable
from services.trainer.checkpointing.resume import SavedRecord
from services.trainer.checkpointing.retention import Purger
from services.trainer.checkpointing.state import Checkpoint
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.intake.feeder import PromptFeeder
from services.trainer.intake.ledger import GroupLedger
from services.trainer.learning.learner import Learner
from services.trainer.progress import Adopted, ConfigSource, Progress
from services.trainer.publisher import Publisher
from services.trainer.served_versions import ServedVersions

log = logging.getLogger(__name__)
# An adoption's weights are offered this often, waiting 0.5 s, then 1 s, between, before the run is held for them.
SERVE_ATTEMPTS = 3
SERVE_BACKOFF_S = 0.5
# Writing the run's record of a save (checkpoint-saved.json) is tried this often, waiting 0.5 s, then 1 s, between.
RECORD_ATTEMPTS = 3
RECORD_BACKOFF_S = 0.5


class AdoptionUnserved(RuntimeError):
    """An adopted step (a resume's, a rollback's) is in force but its weights could not be served to the rollouts."""


@dataclass(frozen=True)
class Unserved:
    """An adoption in force whose weights are not served yet, and what its event says once they are."""

    rollback: bool  # a rollback's, else a resume's
    message: str
    version: int
    fields: dict[str, Any]


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
        journal: Journal,
        telemetry: TrainerMetrics,
        report: Callable[[dict[str, Any]], Awaitable[None]],
        rewind: Callable[[], object],
        hold: Callable[[str], Awaitable[None]] | None = None,
        served: ServedVersions | None = None,
    ):
        """``hold``: pause the run for an operator, with the reason (the trainer's ``Control``); None holds nothing
        (a recovery driven without a loop, as the simulation drives it). ``served``: the run's served-version mark
        on the broker, raised before each version is served and read at a resume; None keeps none (the lineage
        alone then knows the versions served after the newest checkpoint)."""
        self.settings = settings
        self.learner = learner
        self.checkpoints = checkpoints
        self.lineage = lineage
        self.progress = progress
        self.weights = weights
        self.journal = journal
        self.telemetry = telemetry
        self.report = report  # a metrics row about a save: written and judged by the alert rules
        self.rewind = rewind  # re-read EXPERIENCE after progress.applied_seq
        self.hold = hold
        self.build = BuildInfo().resolved()
        self.purger = Purger(settings, checkpoints, progress, ledger, bus)
        parts = Restorable(settings, learner, checkpoints, lineage, progress, ledger, feeder)
        self.checkpointer = Checkpointer(parts, self.purger, telemetry, self.build)
        self.adopter = Adopter(parts, self.purger, journal, served.read if served is not None else None)
        before_serving = served.raise_to if served is not None else None
        self.publisher = Publisher(learner, weights, on_refused=self._weights_refused, before_serving=before_serving)
        self.upload: asyncio.Task | None = None
        self.unserved: Unserved | None = None

    @property
    def claim_keys(self) -> dict[str, int]:
        """Claim-checked EXPERIENCE bodies read and not yet purged, key -> sequence."""
        return self.purger.claim_keys

    def track_claims(self, claim_keys: list[tuple[int, str]]) -> None:
        self.purger.track_claims(claim_keys)

    async def purge_consumed(self) -> None:
        await self.purger.purge_consumed()

    # -- start ------------------------------------------------------------------------

    async def start(self, resume: bool, claim: Callable[[], None] | None = None) -> bool:
        """Adopt the configured or newest checkpoint when resuming; returns whether one was adopted.

        A fresh start refuses a store that already holds steps of this run id (another run's, or this
        one's from before): it would prune, purge and later resume from them. A resume whose store cannot be
        read, or lacks the steps the run's record names, waits for it, then raises ResumeRefused; nothing is
        written before the checkpoint is in hand. ``claim`` (the lease fence) is the first write to the store,
        made once the start has found there what it expects."""
        run_dir = self.settings.cfg.run_dir
        await asyncio.to_thread(self.lineage.catch_up)  # the whole file, once: later reads take only what is new
        if not resume:
            incarnation = await asyncio.to_thread(self.checkpoints.start_fresh)
            if claim is not None:
                await asyncio.to_thread(claim)
            self.progress.started(incarnation)
            SavedRecord.clear(run_dir)  # an earlier run's record under this run id is not this run's
            return False
        try:
            saved = SavedRecord.read(run_dir)
        except ValueError as error:
            # Refused, not crashed: a restart would meet the same file, and guessing past it could resume a step
            # older than the one the run last saved.
            raise ResumeRefused(str(error)) from None
        wanted = self.settings.cfg.checkpoint.resume_step
        if wanted is not None and (
            self.lineage.resumed_to(wanted) or await self.adopter.resumed_already(saved, wanted)
        ):
            # Made already: a restart after it continues from the newest step, not from the requested one again.
            log_event(log, Event.RESUME_STEP_DONE, step=wanted)
            wanted = None
        found = await self.adopter.find_checkpoint(saved, wanted)
        if claim is not None:
            await asyncio.to_thread(claim)
        if found.checkpoint is None:
            adopted = await self.adopter.restart_without_checkpoint()
            self.progress.adopt(adopted)
            if adopted.version:  # the versions this run served before are disowned: rollouts pull the new one
                await self.publish()
            return False
        ckpt = found.checkpoint
        await self.adopt(ckpt, Event.RESUME, reason="trainer start", requested=wanted is not None)
        passed_over = sorted(found.skipped) or ([saved.step] if saved is not None and saved.step > ckpt.step else [])
        if passed_over and wanted is None:
            why = "; ".join(found.skipped.values()) or "no longer stored"
            message = f"resumed from step {ckpt.step}, not from newer step(s) {passed_over}: {why}"
            self.journal.emit(
                Event.CHECKPOINT_FALLBACK,
                message,
                level=logging.WARNING,
                alert=True,
                step=ckpt.step,
                skipped_steps=passed_over,
            )
        return True

    # -- adopt: resume and rollback -----------------------------------------------------

    async def adopt(self, ckpt: Checkpoint, event: str, reason: str, requested: bool = False) -> list[int]:
        """Serve stored step ``ckpt.step`` as a new policy version; returns the steps this abandons.

        ``requested``: a resume to the step named by ``checkpoint.resume_step`` (recorded, so it is made once).
        Once the adopter has changed the store, the adoption is in force; its weights are then served, retried, and
        the adoption is done (its event emitted) only once they are: else ``AdoptionUnserved`` (``_serve``)."""
        await self.publisher.released()  # the learner is about to change under any copy still being taken
        adoption = await self.adopter.take(ckpt, event, requested)
        adopted: Adopted = adoption.adopted
        self.progress.adopt(adopted)
        self.rewind()  # EXPERIENCE is re-read from the adopted step's sequence, served or not
        # The newest live step is now this one: a later resume expects it (or a newer one saved after).
        unrecorded = await self._record_with_retries(ckpt.step)
        if unrecorded:
            await self._unrecorded(ckpt.step, unrecorded, stall_s=0.0)
        abandoned = adoption.abandoned_steps
        self.unserved = Unserved(
            event == Event.ROLLBACK,
            f"{event} to step {ckpt.step} as policy version {adopted.version} ({reason})",
            adopted.version,
            {
                "step": ckpt.step,
                "policy_version": adopted.version,
                "experience_seq": adopted.applied_seq,
                "abandoned_steps": abandoned,
                "abandoned_checkpoints": adoption.abandoned_checkpoints,
                "reason": reason,
            },
        )
        await self._serve()
        return abandoned

    async def serve_pending(self) -> None:
        """Before the next step: serve the weights of an adoption that could not serve them (the run was held; an
        operator resumed it). Failing again holds the run again."""
        if self.unserved is not None:
            with contextlib.suppress(AdoptionUnserved):
                await self._serve()

    async def _serve(self) -> None:
        """Serve the adopted weights as ``unserved.version`` and emit the adoption's event, retried; when they cannot
        be served the rollouts keep the abandoned branch's version: the adoption is not done, the event
        ``adoption_unserved`` alerts, a rollback holds the run (a resume's process exits and its restart tries
        again) and AdoptionUnserved is raised."""
        pending = self.unserved
        assert pending is not None
        error = ""
        for attempt in range(1, SERVE_ATTEMPTS + 1):
            try:
                await self.publish()
            except Exception as failure:  # the copy's or the weight server's: the adoption stands, unserved
                error = repr(failure)[:300]
            else:
                if self.publisher.served >= pending.version:
                    self.unserved = None
                    self.journal.emit(
                        Event.ROLLED_BACK if pending.rollback else Event.RESUMED, pending.message, **pending.fields
                    )
                    return
                error = "the weight server refused them (see step_skipped)"
            if attempt < SERVE_ATTEMPTS:
                delay = SERVE_BACKOFF_S * 2 ** (attempt - 1)
                log_event(log, Event.ADOPTION_SERVE_RETRY, level=logging.WARNING, error=error, retry_s=delay)
                await asyncio.sleep(delay)
        message = (
            f"{pending.message}: its weights could not be served ({error}). Rollouts keep the version they hold, "
            "whose groups are dropped as abandoned; no step is taken until they are served"
        )
        self.journal.emit(
            Event.ADOPTION_UNSERVED,
            message,
            level=logging.ERROR,
            alert=True,
            step=pending.fields["step"],
            policy_version=pending.version,
            error=error,
        )
        if pending.rollback and self.hold is not None:
            await self.hold(f"{message}. `rlpipe resume` serves them again")
        raise AdoptionUnserved(message)

    async def rollback(self, step: int | None, reason: str) -> tuple[int, int, list[int]]:
        """Serve checkpoint ``step`` (None: the newest stable one) as a new policy version.

        The steps after it are abandoned, and so are the policy versions they produced: groups
        those versions generated are dropped when they arrive. EXPERIENCE is re-read from the
        checkpoint's sequence, so the groups the abandoned steps trained on are applied again (or
        dropped, if an abandoned version made them): each group is still accounted for exactly once
        in the steps that make up the model.
        """
        await self.wait_for_upload()  # a save of the state being abandoned must land before it is marked
        ckpt = await self.adopter.rollback_target(step)
        abandoned = await self.adopt(ckpt, Event.ROLLBACK, reason)
        return ckpt.step, self.progress.version, abandoned

    def _record_saved(self, step: int) -> None:
        """Note, fsynced in the run folder, that ``step`` is the newest live step stored (``SavedRecord``)."""
        SavedRecord(
            step=step,
            policy_version=max(self.progress.version, self.lineage.max_version()),
            incarnation=self.progress.incarnation,
            location=f"{self.checkpoints.location()}step-{step:08d}/",
        ).write(self.settings.cfg.run_dir)

    async def publish(self) -> None:
        """Serve the learner's weights as the current policy version, and wait until they are served."""
        await self.publisher.publish(self.progress.version, self.progress.step)

    def offer(self) -> None:
        """Serve the learner's weights as the current policy version, in the background (``Publisher``)."""
        self.publisher.offer(self.progress.version, self.progress.step)

    async def _weights_refused(self, error: NonFiniteWeights, version: int, step: int) -> None:
        """A version whose weights are not finite is not served: the step is reported skipped, and a metrics row
        with loss NaN for it goes to the alert rules (``nan_loss`` pauses the run by default)."""
        message = f"step {step}: {error}"
        self.journal.emit(Event.STEP_SKIPPED, message, level=logging.ERROR, alert=True, step=step, reason=str(error))
        await self.report(
            {"step": step, "policy_version": version, "config_version": self.settings.version, "loss": math.nan}
        )

    # -- save ---------------------------------------------------------------------------

    async def wait_for_upload(self) -> None:
        if self.upload is not None and not self.upload.done():
            await self.upload

    async def save(self, config_version: int, wait: bool = False) -> None:
        """Checkpoint in the background; with ``wait``, until it is stored (or has failed)."""
        if self.upload is not None and not self.upload.done():
            if not wait:
                log_event(
                    log,
                    Event.CHECKPOINT_DEFERRED,
                    level=logging.WARNING,
                    step=self.progress.step,
                    reason="previous upload still running",
                )
                return
            await self.upload
            if self.progress.saved_in_full:
                return  # that upload was this very step, with the optimizer state
        took = Stopwatch()
        await self.publisher.released()  # the snapshot reads the learner: after the newest version's copy
        taken = await self.checkpointer.snapshot(config_version, final=wait)
        stall_s = took()
        self.telemetry.record_checkpoint_stall(stall_s)
        self.upload = asyncio.create_task(self._upload(taken.checkpoint, stall_s=stall_s, lineage_s=taken.lineage_s))
        if wait:
            await self.upload

    async def _upload(self, ckpt: Checkpoint, stall_s: float, lineage_s: float) -> None:
        """Store ``ckpt``; ``stall_s``: how long taking it held the training step, ``lineage_s``: of which reading
        the lineage."""
        outcome = await self.checkpointer.store(ckpt)
        if outcome.error:
            # The row carries the current step: the save's own step may be behind, and is not one to roll back to.
            row = {"step": self.progress.step, "checkpoint_failed": 1, "checkpoint_stall_s": stall_s}
            await self.report({**row, "error": outcome.error})
            return
        unrecorded = await self._record_with_retries(max(self.progress.saved_step, ckpt.step))
        if unrecorded:
            await self._unrecorded(ckpt.step, unrecorded, stall_s)
            return
        self.progress.saved(ckpt.step, whole=ckpt.optimizer is not None)
        # checkpoint_failed 0 clears a checkpoint-failure alert that an earlier save raised.
        await self.report(
            {
                "step": self.progress.step,
                "checkpoint_saved": 1,
                "checkpoint_failed": 0,
                "checkpoint_time_s": outcome.seconds,
                "checkpoint_stall_s": stall_s,
                "checkpoint_lineage_s": lineage_s,
            }
        )
        log_event(
            log,
            Event.CHECKPOINT,
            step=ckpt.step,
            location=outcome.location,
            save_s=outcome.seconds,
            stall_s=stall_s,
            optimizer=ckpt.optimizer is not None,
        )
        await self.purger.purge_consumed()

    async def _record_with_retries(self, step: int) -> str:
        """Write the record that ``step`` is saved (``_record_saved``), retried; "" once written, else the error."""
        failure = ""
        for attempt in range(1, RECORD_ATTEMPTS + 1):
            try:
                await asyncio.to_thread(self._record_saved, step)
                return ""
            except OSError as error:  # a full disk, a read-only or vanished runs volume
                failure = repr(error)[:300]
            if attempt < RECORD_ATTEMPTS:
                delay = RECORD_BACKOFF_S * 2 ** (attempt - 1)
                log_event(log, Event.CHECKPOINT_RECORD_RETRY, level=logging.WARNING, step=step, retry_s=delay)
                await asyncio.sleep(delay)
        return failure

    async def _unrecorded(self, step: int, error: str, stall_s: float) -> None:
        """Step ``step`` is stored but the run's record of it could not be written: without the record an emptied
        store would read as a first start (``resume.py``), so the save does not count (``progress.saved_step``
        stays, the run ends unsaved if it ends now) and the run is held until an operator has looked."""
        run_dir = self.settings.cfg.run_dir
        message = (
            f"step {step} is stored, but {run_dir / SavedRecord.FILE} could not be written ({error}): until it is, a "
            "restart that finds the store empty would take the run for a new one. Make the run folder writable, then "
            "`rlpipe resume` and `rlpipe checkpoint` to write it"
        )
        self.journal.emit(
            Event.CHECKPOINT_RECORD_FAILED, message, level=logging.ERROR, alert=True, step=step, error=error
        )
        await self.report(
            {"step": self.progress.step, "checkpoint_failed": 1, "checkpoint_stall_s": stall_s, "error": message}
        )
        if self.hold is not None:
            await self.hold(f"checkpoint record: {message}")

    # -- operator calls -------------------------------------------------------------

    async def catalog(self) -> list[CatalogEntry]:
        return await asyncio.to_thread(self.checkpoints.catalog)

    async def entry(self, step: int) -> CatalogEntry | None:
        return next((e for e in await self.catalog() if e.step == step), None)

    async def checkpoint_now(self, config_version: int) -> CatalogEntry | None:
        """Store the current step (unless it already is, with the optimizer state) and describe it; None if the save
        failed."""
        step = self.progress.step
        if not self.progress.saved_in_full or step not in await asyncio.to_thread(self.checkpoints.steps):
            await self.save(config_version, wait=True)
        return await self.entry(step)

    async def mark_stable(self, step: int) -> CatalogEntry | None:
        """Run between steps: never beside a save of the same step, which rewrites its folder."""
        await self.wait_for_upload()
        await asyncio.to_thread(self.checkpoints.mark, step, STABLE)
        log_event(log, Event.MARKED_STABLE, step=step)
        return await self.entry(step)
