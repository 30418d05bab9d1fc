"""Adopting a stored step, for a resume and for a rollback: finding it, checking it, and changing the store, the
learner, the ledger and the lineage for it. What the running state becomes is returned (``Adoption``); recovery.py
puts it in force.

It is all-or-nothing in this order: the checkpoint is read and checked whole against the model (keys, shapes,
dtypes, finite values: nothing is copied before), the store is changed (every later step marked ABANDONED, which is
idempotent, so a failure here changes nothing in memory and the same call can be made again), and only then is the
learner loaded, the ledger and the lineage written. Policy versions only grow across restarts: the versions that the
abandoned steps produced are disowned, and groups they generated are dropped on arrival.

A resume never takes an unreadable store for an empty one (``services/trainer/checkpointing/resume.py``): it waits up to
``checkpoint.resume_wait_s`` for the store, and then refuses to start, having written nothing to the lineage or the
store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from services.common.config import CheckpointConfig
from services.common.observe.events import Event, Journal
from services.common.observe.logs import log_event
from services.common.refusal import StartRefused
from services.trainer.checkpointing.lineage import settled_after
from services.trainer.checkpointing.manifest import UnknownCheckpointFormat
from services.trainer.checkpointing.restorable import Restorable
from services.trainer.checkpointing.resume import ResumeBlocked, SavedRecord, StoreUnreadable
from services.trainer.checkpointing.retention import Purger
from services.trainer.checkpointing.state import Checkpoint, CheckpointCorrupt, new_incarnation
from services.trainer.checkpointing.step_reader import UNREADABLE, ForeignCheckpoints, Resumable
from services.trainer.progress import Adopted, ProcessState

log = logging.getLogger(__name__)
RESUME_RETRY_MAX_S = 30.0  # the longest pause between two looks at an unreadable store
T = TypeVar("T")


class ResumeRefused(StartRefused):
    """The checkpoint a resume needs stayed unreadable for ``checkpoint.resume_wait_s``: the trainer does not start."""


async def wait_for_store(
    call: Callable[[], T], cfg: CheckpointConfig, store: str, refusing: str, record: str = ""
) -> T:
    """``call()`` on a worker thread, again while it raises ResumeBlocked: each wait logs ``resume_waiting`` (an
    alert) and doubles, up to ``RESUME_RETRY_MAX_S``; past ``cfg.resume_wait_s`` it raises ResumeRefused, its message
    ``refusing`` (what is not done), the error, and ``record`` (what the run's own record says)."""
    started = time.monotonic()
    delay = 1.0
    while True:
        try:
            return await asyncio.to_thread(call)
        except ResumeBlocked as error:
            waited = time.monotonic() - started
            if waited + delay > cfg.resume_wait_s:
                raise ResumeRefused(
                    f"{refusing}: {error}{record}. Waited {waited:.0f} s (checkpoint.resume_wait_s: "
                    f"{cfg.resume_wait_s:g}); nothing was written. Bring the store back and start the run again; "
                    "starting it without --resume abandons its training."
                ) from error
            log_event(
                log,
                Event.RESUME_WAITING,
                level=logging.ERROR,
                alert=True,
                store=store,
                error=str(error)[:500],
                waited_s=round(waited, 1),
                retry_s=delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESUME_RETRY_MAX_S)


@dataclass(frozen=True)
class Adoption:
    """What adopting a step did: the state to go on from, and what it abandoned."""

    adopted: Adopted
    abandoned_steps: list[int]  # the lineage's steps after the adopted one
    abandoned_checkpoints: list[int]  # the stored steps it marked ABANDONED


class Adopter:
    def __init__(
        self,
        parts: Restorable,
        purger: Purger,
        journal: Journal,
        served_mark: Callable[[], Awaitable[int]] | None = None,
    ):
        """``served_mark``: the highest version the run served, from the broker (``ServedVersions.read``)."""
        self.parts = parts
        self.purger = purger
        self.journal = journal
        self.served_mark = served_mark

    async def _served_elsewhere(self) -> int:
        """The highest version served as the broker records it: on another machine, or past what this run folder's
        lineage kept, a resume still disowns the versions served after the step it adopts."""
        return await self.served_mark() if self.served_mark is not None else 0

    # -- finding the step -----------------------------------------------------------------

    async def find_checkpoint(self, saved: SavedRecord | None, wanted: int | None) -> Resumable:
        """The checkpoint to resume from (``wanted``, or the newest), waiting for a store that cannot be read."""
        checkpoints = self.parts.checkpoints

        def find() -> Resumable:
            if wanted is not None:
                return Resumable(self._load_requested(wanted))
            return checkpoints.load_newest(saved.step if saved else None)

        record = f"; this run last saved step {saved.step} at {saved.location}" if saved else ""
        where = checkpoints.location()
        return await wait_for_store(
            find, self.parts.settings.cfg.checkpoint, where, f"not resuming from {where}", record
        )

    async def resumed_already(self, saved: SavedRecord | None, wanted: int) -> bool:
        """Whether the stored steps' lineage records the requested resume to ``wanted`` as made: the newest live
        step's copy, read when the run folder's own lineage.jsonl does not (a run folder lost or moved to another
        machine), so that the resume is not made again, abandoning every step saved after it. A store that cannot
        be read is waited for as a resume waits for it."""
        checkpoints = self.parts.checkpoints
        record = f"; this run last saved step {saved.step} at {saved.location}" if saved else ""
        where = checkpoints.location()
        done = await wait_for_store(
            lambda: wanted in checkpoints.requested_resumes(saved.step if saved else None),
            self.parts.settings.cfg.checkpoint,
            where,
            f"not resuming from {where}",
            record,
        )
        return done

    def _load_requested(self, step: int) -> Checkpoint:
        """Step ``step`` (``checkpoint.resume_step``); a store that fails to answer is waited for, not a refusal.

        A step that is not stored, or whose copies do not load, is refused (ResumeRefused, exit 2) naming it: a
        restart with the same config would meet it again."""
        checkpoints = self.parts.checkpoints
        try:
            return checkpoints.load(step)
        except FileNotFoundError:
            try:
                stored = f" (stored: {checkpoints.steps()})"
            except Exception:  # the listing is only for the message
                stored = ""
            raise ResumeRefused(
                f"checkpoint.resume_step {step}: no step {step} is stored at {checkpoints.location()}{stored}. Name "
                "a stored step, or unset checkpoint.resume_step to resume from the newest; nothing was written"
            ) from None
        except CheckpointCorrupt as error:
            raise ResumeRefused(
                f"checkpoint.resume_step {step}: step {step} at {checkpoints.location()} does not load ({error}). "
                "Name another step, or unset checkpoint.resume_step to resume from the newest; nothing was written"
            ) from error
        except (UnknownCheckpointFormat, ForeignCheckpoints):
            raise
        except Exception as error:  # the store's many failure types
            raise StoreUnreadable(f"cannot read step {step}: {error!r}"[:500]) from error

    async def rollback_target(self, step: int | None) -> Checkpoint:
        """Stored step ``step`` (None: the newest stable one); LookupError when there is none, CheckpointCorrupt
        when it cannot be loaded. Nothing changes either way."""
        stored = await asyncio.to_thread(self.parts.checkpoints.steps)
        if step is None:
            step = await asyncio.to_thread(self.parts.checkpoints.latest_stable)
            if step is None:
                raise LookupError("no checkpoint is marked stable (rlpipe mark-stable STEP)")
        elif step not in stored:
            raise LookupError(f"no stored checkpoint at step {step} (stored: {stored})")
        try:
            return await asyncio.to_thread(self.parts.checkpoints.load, step)
        except UNREADABLE as error:
            raise CheckpointCorrupt(
                f"the checkpoint of step {step} cannot be loaded ({error}); nothing was changed"
            ) from error

    # -- adopting it ----------------------------------------------------------------------

    async def restart_without_checkpoint(self) -> Adopted:
        """A restart before the run's first checkpoint: a new incarnation, whose policy versions still grow past
        any this run served (rollouts may hold them), and which abandons the steps taken before."""
        incarnation = self.parts.checkpoints.incarnation = new_incarnation()
        applied_seq = await self.purger.read_on_after(0)
        version = self.parts.progress.version
        served = max(self.parts.lineage.max_version(), await self._served_elsewhere())
        if served:
            version = served + 1
            await asyncio.to_thread(
                self.parts.lineage.restart_from, 0, version, "restart", abandoned_versions=(1, served)
            )
        return Adopted(
            step=0,
            version=version,
            applied_seq=applied_seq,
            incarnation=incarnation,
            last_eval=self.parts.progress.last_eval,
            abandoned_versions=self.parts.lineage.abandoned_versions(),
        )

    async def take(self, ckpt: Checkpoint, event: str, requested: bool = False) -> Adoption:
        """Adopt stored step ``ckpt.step`` as a new policy version (``event``: resume or rollback).

        ``requested``: a resume to the step named by ``checkpoint.resume_step`` (recorded, so it is made once)."""
        # Staging: the checkpoint must fit the model whole before the store or the running state changes.
        await asyncio.to_thread(self.parts.learner.check, ckpt)
        # The store learns whose steps it keeps first (setting it again on a retry is harmless), so that
        # marking later steps abandoned, which may fail and leaves memory untouched, spares other runs' steps.
        incarnation = self.parts.checkpoints.adopt_incarnation(ckpt)
        stored_high_water = await asyncio.to_thread(self.parts.checkpoints.version_high_water)
        later = await asyncio.to_thread(self.parts.checkpoints.abandon_after, ckpt.step)
        state = ckpt.state
        read_from = await self.purger.read_on_after(state.last_experience_seq)
        # Versions only grow: past any this run served, by what the lineage, this checkpoint and every stored step
        # say (a lineage.jsonl that lost its tail in a node crash is covered by the checkpoints).
        served = max(
            self.parts.progress.version,
            self.parts.lineage.max_version(),
            state.policy_version,
            state.version_high_water,
            await self._served_elsewhere(),
        )
        new_version = max(served, stored_high_water) + 1
        disowned = (state.policy_version + 1, new_version - 1)
        await asyncio.to_thread(self.parts.learner.load, ckpt)
        self.parts.learner.reconfigure(self.parts.settings.cfg)  # the live hyperparameters stay in force
        if ckpt.optimizer is None:
            message = (
                f"step {ckpt.step} was saved without optimizer state (checkpoint.optimizer_every): the optimizer "
                "starts fresh, its moments at zero"
            )
            self.journal.emit(Event.OPTIMIZER_FRESH, message, level=logging.WARNING, step=ckpt.step)
        self.purger.track_claims(state.claim_keys)
        process = None
        if event == Event.RESUME:
            # A new process: the cursor, the in-flight groups and what the lineage settled are the checkpoint's; a
            # rollback keeps reading DEAD where it is (dead letters are facts about the pipeline).
            self.parts.feeder.seek(state.data_cursor)
            self.parts.ledger.restore(
                state.in_flight,
                state.applied_ids,
                state.dead_ids,
                state.reinjected,
                ckpt.step,
                time.monotonic(),
                state.settled_through,
            )
            process = ProcessState(state.dead_seq, state.baseline_accuracy, dict(state.metrics))
        else:
            # The same process goes back: prompts already fed stay in flight and are not fed again.
            abandoned_groups = settled_after(await asyncio.to_thread(self.parts.lineage.records), ckpt.step)
            undone = self.parts.ledger.rewind(
                state.applied_ids,
                ckpt.step,
                time.monotonic(),
                state.settled_through,
                abandoned_groups,
                dead=state.dead_ids,
            )
            if undone:
                message = f"{len(undone)} group(s) the abandoned steps had settled are in flight again"
                self.journal.emit(
                    Event.GROUPS_REOPENED_BY_ROLLBACK, message, step=ckpt.step, count=len(undone), group_ids=undone[:50]
                )
        # On a thread: a lineage.jsonl copied from the checkpoint (a new machine's run folder) is read whole here.
        abandoned = await asyncio.to_thread(
            self.parts.lineage.restart_from,
            ckpt.step,
            new_version,
            "resume" if event == Event.RESUME else "rollback",
            copy_if_missing=ckpt.lineage,
            abandoned_versions=disowned if disowned[1] >= disowned[0] else None,
            requested=requested,
        )
        adopted = Adopted(
            step=ckpt.step,
            version=new_version,
            applied_seq=read_from,
            incarnation=incarnation,
            last_eval=state.eval_accuracy,
            abandoned_versions=self.parts.lineage.abandoned_versions(),
            process=process,
        )
        return Adoption(adopted, abandoned, later)
