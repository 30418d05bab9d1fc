"""Checkpoint store I/O: a run's steps on its store and mirror (their format is ``manifest.py``'s).

Incarnations
------------
Every start of a run that is not a resume is a new *incarnation* with a fresh id
(``start_fresh``); a resume takes over the id of the checkpoint it continues
(``adopt_incarnation``). Every manifest carries the id. Once a ``CheckpointStore`` knows its
incarnation, steps whose manifest names another one are *foreign*: they are not listed,
loaded, vouched for, abandoned, counted for the replay floor, pruned or overwritten; they
belong to another run that happens to share the prefix. A manifest without the field
(written before incarnations existed) belongs to whichever incarnation resumes it. A store
whose incarnation is still None (a trainer that has not yet decided between resuming and a
fresh start) sees every step and cannot save.

A fresh start on a prefix that already holds checkpoints is refused (``check_fresh_start``
raises ``ForeignCheckpoints``) rather than run beside them: a restarted trainer finds its
checkpoint with ``load_latest`` before it knows its incarnation, and would take the newest
step of either run.

What a reader sees while ``save`` runs
--------------------------------------
- A new step: nothing until its manifest lands (parts first, manifest last).
- The same step saved again by the same incarnation with the same policy version and
  EXPERIENCE sequence (a retry after a failed prune or mirror copy, or "checkpoint now" on
  a step just saved): nothing changes. The stored copy (and its STABLE mark) stands; only
  pruning and the mirror copy are redone. The stored parts are not re-verified. Except that
  a copy without optimizer state (``checkpoint.optimizer_every``) gains the new save's: its
  optimizer part is written, then the stored manifest with that part added. A reader loads
  the old copy until then, and the whole one from then.
- A step of the same number from another branch (an abandoned step, or a live copy with a
  different policy version or sequence): the old copy is marked ABANDONED first unless it
  already is, so from then on every reader skips it as it skips any abandoned step. Then
  parts the new copy does not have (and the old STABLE mark) are deleted, the new parts and
  the new manifest are written, and the ABANDONED mark is deleted last: the new copy exists
  from that moment. An interrupted save leaves an abandoned step, which the next save of
  that number replaces and pruning drops first. Other live steps are never touched, so at
  no moment is a live step of the current branch without a loadable copy.
- A foreign step of the same number: the save raises ``ForeignCheckpoints`` and writes nothing.
- Pruning deletes a step's manifest before its parts: the step vanishes at once rather than
  being seen half-deleted (a reader that listed it just before finds it missing or corrupt
  and takes another step, as ``load_latest`` does).

Once the manifest and its markers are on the primary store the step is stored: a failure
while pruning or copying to the mirror afterwards is logged (``prune_failed``,
``mirror_failed``) and ``save`` returns normally; the next save prunes and mirrors again. Each copy to the mirror
also marks ABANDONED there every live step above the primary's oldest live one that the primary does not hold live:
a rollback's marks that the mirror missed (``abandon_after`` only logs its failures there), which the primary's own
copies, pruned at its next save, would otherwise no longer tell apart from the current branch's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.transport.storage import ObjectStore
from services.common.transport.weightsync.snapshot import NonFiniteWeights, non_finite
from services.trainer.checkpointing.manifest import (
    ABANDONED,
    MANIFEST,
    MODEL_SIDECARS,
    STABLE,
    Manifest,
    PartMeta,
    compress_parts,
    describe,
    encode_parts,
    marker_note,
)
from services.trainer.checkpointing.retention import prunable
from services.trainer.checkpointing.state import Checkpoint, new_incarnation
from services.trainer.checkpointing.step_reader import ForeignCheckpoints, StepReader

log = logging.getLogger(__name__)


class AbandonedStep(ValueError):
    pass


class CheckpointStore(StepReader):
    """Saving, loading, marking and pruning a run's steps (the module docstring says in which order)."""

    # -- incarnations -------------------------------------------------------------------
    def check_fresh_start(self) -> None:
        """Raise ForeignCheckpoints when the run's prefix (on the store or its mirror) holds any checkpoint.

        A fresh start must not share a prefix with an earlier run: its steps would be pruned
        against the old ones and a restart could resume the old run. An unreachable mirror
        does not block the start (it is a second copy); an unreachable primary raises its error.
        """
        found: dict[str, list[int]] = {}
        for store in (self.store, self.mirror):
            if store is None:
                continue
            try:
                steps = self.steps(store, include_abandoned=True, include_foreign=True)
            except Exception as error:
                if store is self.store:
                    raise
                log_event(log, Event.MIRROR_FAILED, level=logging.WARNING, store=store.url, error=repr(error)[:300])
                continue
            if steps:
                found[self.location(store)] = steps
        if found:
            where = "; ".join(f"{prefix} holds steps {steps}" for prefix, steps in found.items())
            raise ForeignCheckpoints(
                f"checkpoints of an earlier run are in the way of a fresh start: {where}. "
                f"Continue that run with `rlpipe run --resume`, or start a new one under another run_id.",
                found,
            )

    def start_fresh(self, incarnation: str | None = None) -> str:
        """``check_fresh_start``, then take ``incarnation`` (default: a new id) for every save; returns it."""
        self.check_fresh_start()
        self.incarnation = incarnation or new_incarnation()
        return self.incarnation

    def adopt_incarnation(self, ckpt: Checkpoint) -> str:
        """Continue the incarnation that saved ``ckpt``; returns it.

        A checkpoint from before incarnations gets a new id: the steps without one stay
        this incarnation's (and anyone's that resumes them)."""
        self.incarnation = ckpt.incarnation or new_incarnation()
        return self.incarnation

    # -- saving -----------------------------------------------------------------------------

    def save(self, ckpt: Checkpoint, model_dir: Path) -> str:
        """Store ``ckpt`` (see the module docstring for the order of writes); returns the step's location.

        Raises RuntimeError before the store has an incarnation, ValueError when the state names
        another one, ForeignCheckpoints when another incarnation holds the step, and the store's
        error when the primary copy cannot be written. Pruning and mirror failures are only logged.
        """
        if self.incarnation is None:
            raise RuntimeError("checkpoint store has no incarnation yet: start_fresh() or adopt_incarnation() first")
        if ckpt.state.incarnation != self.incarnation:
            raise ValueError(
                f"step {ckpt.step}: its state names incarnation {ckpt.state.incarnation!r}, "
                f"the store writes for {self.incarnation!r}"
            )
        broken = non_finite([*ckpt.model.items(), *(ckpt.critic or {}).items()])
        if broken:  # a resume or rollback to it would bring the NaN back
            raise NonFiniteWeights(f"step {ckpt.step} is not saved: NaN or inf in {', '.join(broken[:3])}")
        sidecars = {name: (model_dir / name).read_bytes() for name in MODEL_SIDECARS if (model_dir / name).is_file()}
        parts = encode_parts(ckpt, sidecars)
        compressed: dict[str, PartMeta] = {}
        if self.compression == "zlib":
            parts, compressed = compress_parts(ckpt, parts)
        manifest = describe(ckpt, parts, self.incarnation, self.epoch, compressed)
        stable = self._write_step(self.store, ckpt.step, parts, manifest, stable=False)
        # From here the step is stored: what follows is housekeeping that the next save redoes.
        kept: list[int] | None = None
        try:
            kept = self._prune(self.store)
        except Exception as error:
            log_event(log, Event.PRUNE_FAILED, level=logging.WARNING, step=ckpt.step, error=repr(error)[:300])
        if self.mirror is not None:
            try:
                self._write_step(self.mirror, ckpt.step, parts, manifest, stable=stable)
                self._disown_on_mirror(self.steps(self.store) if kept is None else kept)
                self._prune(self.mirror)
            except Exception as error:  # the primary copy stands; the mirror catches up at the next save
                log_event(log, Event.MIRROR_FAILED, level=logging.WARNING, step=ckpt.step, error=repr(error)[:300])
        return f"{self.store.url.rstrip('/')}/{self._prefix(ckpt.step)}"

    def _write_step(
        self, store: ObjectStore, step: int, parts: dict[str, bytes], manifest: Manifest, stable: bool
    ) -> bool:
        """Put one step on ``store`` so that no reader ever meets a mix of two copies; returns whether it is STABLE.

        ``stable``: mark the new copy STABLE (the mirror follows the primary's mark)."""
        prefix = self._prefix(step)
        names = {key[len(prefix) :] for key in self._retried(prefix, lambda: store.list(prefix))}
        found_manifest = False
        old: Manifest | None = None  # None beside a manifest: one that is not a manifest (bitrot)
        if MANIFEST in names:
            try:
                old = Manifest.parse(self._retried(prefix + MANIFEST, lambda: store.get(prefix + MANIFEST)))
                found_manifest = True
            except FileNotFoundError:
                names.discard(MANIFEST)  # pruned since the listing: what is left are stale parts
        if found_manifest:
            owner = old.incarnation if old is not None else None
            if owner is not None and owner != self.incarnation:
                found = {self.location(store): [step]}
                raise ForeignCheckpoints(
                    f"{store.url.rstrip('/')}/{prefix} holds step {step} of another run incarnation ({owner}); "
                    f"not overwriting it. Continue that run with `rlpipe run --resume`, or use another run_id.",
                    found,
                )
            if old is not None and old.same_save(manifest) and ABANDONED not in names:
                upgraded = old.with_optimizer_of(manifest)
                if upgraded is not None:
                    # A copy without optimizer state (checkpoint.optimizer_every) saved again at a stop or on
                    # request: the part first, then the manifest that lists it. Readers load the copy throughout.
                    for name in set(upgraded.files) - set(old.files):
                        self._put_in_step(prefix + name, parts[name], store)
                    self._put_in_step(prefix + MANIFEST, upgraded.to_bytes(), store)
                if stable and STABLE not in names:
                    self._put_in_step(prefix + STABLE, marker_note(), store)
                return stable or STABLE in names  # saved already: the stored copy stands
            if ABANDONED not in names:
                # Another branch's live copy: disown it before touching a part, so readers skip it from now on.
                log_event(
                    log,
                    Event.CHECKPOINT_REPLACED,
                    level=logging.WARNING,
                    step=step,
                    store=store.url,
                    policy_version=old.policy_version if old is not None else None,
                    new_policy_version=manifest.policy_version,
                )
                self._put_in_step(prefix + ABANDONED, marker_note(), store)
                names.add(ABANDONED)
        keep = set(parts) | {MANIFEST, ABANDONED} | ({STABLE} if stable else set())
        # A step without a manifest, or an abandoned one, may lose parts: no reader uses them.
        self._delete(sorted(prefix + name for name in names - keep), store)
        for name, data in parts.items():
            self._put_in_step(prefix + name, data, store)
        self._put_in_step(prefix + MANIFEST, manifest.to_bytes(), store)
        if stable:
            self._put_in_step(prefix + STABLE, marker_note(), store)
        if ABANDONED in names:
            self._delete([prefix + ABANDONED], store)  # last: the new copy exists from here
        return stable

    def _prune(self, store: ObjectStore) -> list[int]:
        """Keep the newest ``keep_last`` live steps and every stable one; abandoned steps go first. Returns the live
        steps kept, oldest first.

        Foreign steps are not this run's to delete: they stay."""
        own = self._owned(store)
        doomed = prunable(own, self.keep_last)
        for step in doomed:
            prefix = self._prefix(step)
            self._delete([prefix + MANIFEST], store)  # first: the step is gone at once, never half-deleted
            self._retried(prefix, lambda prefix=prefix: store.delete_prefix(prefix))
        return [entry.step for entry in own if entry.live and entry.step not in doomed]

    def _disown_on_mirror(self, primary_live: list[int]) -> None:
        """Mark ABANDONED on the mirror each live step newer than the primary's oldest live one that the primary
        does not hold live: a branch that a rollback or resume abandoned while the mirror was out of reach.

        The primary holds the truth, and once it has pruned its abandoned copies nothing else tells the mirror's
        apart from the current branch's. Older steps stay: the mirror may be the only copy of a step that the
        primary lost (a resume from the mirror onto an emptied primary), and pruning drops them in its own time."""
        assert self.mirror is not None
        oldest = min(primary_live, default=None)
        entries = self._retried(self.run_id, lambda: self._owned(self.mirror))
        stale = [
            e.step for e in entries if e.live and oldest is not None and e.step > oldest and e.step not in primary_live
        ]
        for step in sorted(stale, reverse=True):  # newest first, as abandon_after marks them
            self._put_in_step(self._prefix(step) + ABANDONED, marker_note(), self.mirror)
        if stale:
            log_event(log, Event.CHECKPOINTS_ABANDONED, level=logging.WARNING, store=self.mirror.url, steps=stale)

    def mark(self, step: int, marker: str) -> None:
        """Put ``marker`` (STABLE or ABANDONED) beside the manifest of ``step``; on the mirror too if it has it."""
        if marker not in (STABLE, ABANDONED):
            raise ValueError(f"unknown marker {marker!r}: {STABLE} or {ABANDONED}")
        entry = next((e for e in self._scan(manifests=self.incarnation is not None) if e.step == step), None)
        if entry is None:
            raise KeyError(f"no checkpoint at step {step} (stored: {self.steps()})")
        if self._foreign(entry):
            raise KeyError(f"step {step} belongs to another run incarnation ({entry.owner}), not to this one")
        if marker == STABLE and not entry.live:
            raise AbandonedStep(
                f"step {step} was abandoned by a rollback and cannot be marked stable (live steps: {self.steps()})"
            )
        note = marker_note()
        self._put_in_step(self._prefix(step) + marker, note)
        if self.mirror is not None:
            try:
                if step in self.steps(self.mirror, include_abandoned=True):
                    self._put_in_step(self._prefix(step) + marker, note, self.mirror)
            except Exception as error:  # the primary holds the truth
                log_event(log, Event.MIRROR_FAILED, level=logging.WARNING, step=step, error=repr(error)[:300])

    def abandon_after(self, step: int) -> list[int]:
        """Mark every live step of this incarnation after ``step`` ABANDONED, on the mirror too; returns the
        steps it marked on the primary store (none when run again: it is idempotent).

        For a resume from an older step and for a rollback, before any in-memory state changes:
        if it raises (the primary could not be marked), nothing else has changed and it can be
        run again. Newest first, so an interrupted call leaves the live steps one unbroken branch
        from the oldest. The mirror's failures are logged: the primary holds the truth, and the next save's copy to
        the mirror marks there what this call missed (``_disown_on_mirror``).
        """
        marked = self._abandon_after(self.store, step)
        if self.mirror is not None:
            try:
                self._abandon_after(self.mirror, step)
            except Exception as error:
                log_event(log, Event.MIRROR_FAILED, level=logging.WARNING, step=step, error=repr(error)[:300])
        if marked:
            log_event(log, Event.CHECKPOINTS_ABANDONED, after_step=step, steps=marked)
        return marked

    def _abandon_after(self, store: ObjectStore, step: int) -> list[int]:
        entries = self._retried(self.run_id, lambda: self._scan(store, manifests=self.incarnation is not None))
        later = [e.step for e in entries if e.step > step and e.live and not self._foreign(e)]
        for later_step in sorted(later, reverse=True):
            self._put_in_step(self._prefix(later_step) + ABANDONED, marker_note(), store)
        return sorted(later)
