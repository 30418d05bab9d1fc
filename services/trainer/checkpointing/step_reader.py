"""The read side of a run's checkpoint store: which steps it holds (this incarnation's, or every one's), their
catalog, and loading the newest one that loads, from the store or else its mirror (the module docstring of
``store.py`` says what a reader sees while a save runs)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.transport.storage import ObjectStore
from services.trainer.checkpointing.lineage import requested_resumes
from services.trainer.checkpointing.manifest import (
    ABANDONED,
    MANIFEST,
    STABLE,
    CatalogEntry,
    Manifest,
    StoredStep,
    UnknownCheckpointFormat,
    decode_checkpoint,
)
from services.trainer.checkpointing.resume import (
    CheckpointsMissing,
    StoreListing,
    StoreUnreadable,
    fenced_out,
    resume_candidates,
)
from services.trainer.checkpointing.retention import replay_floor
from services.trainer.checkpointing.state import Checkpoint, CheckpointCorrupt
from services.trainer.checkpointing.step_store import StepStore

log = logging.getLogger(__name__)


@dataclass
class Resumable:
    """What a resume found: the newest loadable step, and the newer ones it had to pass over (step -> why)."""

    checkpoint: Checkpoint | None
    skipped: dict[int, str] = field(default_factory=dict)


class ForeignCheckpoints(RuntimeError):
    """Checkpoints of another run incarnation are in the way: a fresh start over them, or a save over one."""

    def __init__(self, message: str, found: dict[str, list[int]]):
        super().__init__(message)
        self.found = found  # store prefix (url/run_id/) -> the steps found there


# What a stored copy that cannot be used raises: another copy or an older step may do.
UNREADABLE = (CheckpointCorrupt, OSError, KeyError, ValueError)


class StepReader(StepStore):
    """Listing and loading a run's steps; ``CheckpointStore`` (store.py) adds saving, marking and pruning."""

    # -- reading ------------------------------------------------------------------------------

    def steps(
        self, store: ObjectStore | None = None, include_abandoned: bool = False, include_foreign: bool = False
    ) -> list[int]:
        """Steps that have a manifest, oldest first; this incarnation's only, unless ``include_foreign``."""
        return [entry.step for entry in self._owned(store, include_foreign) if include_abandoned or entry.live]

    def step_marks(self, store: ObjectStore | None = None) -> tuple[list[int], frozenset[int]]:
        """This incarnation's steps that have a manifest in ``store``: the live ones, oldest first, and those marked
        ABANDONED or landed by a fenced-out writer (``resume.fenced_out``), which a resume takes as abandoned (its
        adoption then marks them so), one listing for all."""
        entries = self._owned(store, manifests=True)
        live = [(e.step, e.manifest.fence_epoch if e.manifest is not None else None) for e in entries if e.live]
        overtaken = fenced_out(live)
        for step in sorted(overtaken):
            log_event(log, Event.CHECKPOINT_SKIPPED, level=logging.WARNING, step=step, reason="fenced-out writer")
        return (
            [step for step, _ in live if step not in overtaken],
            frozenset(e.step for e in entries if not e.live) | overtaken,
        )

    def _owned(
        self, store: ObjectStore | None, include_foreign: bool = False, manifests: bool = False
    ) -> list[StoredStep]:
        """The stored steps with a manifest, oldest first: this incarnation's only, unless ``include_foreign``;
        with ``manifests`` each with its manifest read (also read whenever the incarnation is known)."""
        check_owner = self.incarnation is not None and not include_foreign
        entries = self._scan(store, manifests=check_owner or manifests)
        return [e for e in entries if not (check_owner and self._foreign(e))]

    def catalog(self, include_foreign: bool = False) -> list[CatalogEntry]:
        """Every stored step of this incarnation (and of others with ``include_foreign``) with its markers,
        size, policy version and incarnation, oldest first. A step whose manifest cannot be read is left out."""
        entries = []
        for entry in self._scan():
            if entry.manifest is None:
                log_event(
                    log, Event.CHECKPOINT_SKIPPED, level=logging.WARNING, step=entry.step, reason="unreadable manifest"
                )
                continue
            foreign = self._foreign(entry)
            if foreign and not include_foreign:
                continue
            manifest = entry.manifest
            entries.append(
                CatalogEntry(
                    step=entry.step,
                    policy_version=manifest.policy_version,
                    last_experience_seq=manifest.last_experience_seq,
                    created=manifest.created,
                    bytes=manifest.size,
                    stable=STABLE in entry.names,
                    abandoned=ABANDONED in entry.names,
                    incarnation=entry.owner,
                    foreign=foreign,
                    location=f"{self.store.url.rstrip('/')}/{self._prefix(entry.step)}",
                )
            )
        return entries

    def replay_floor(self, read_seq: int) -> int | None:
        """``retention.replay_floor`` over this incarnation's stored steps."""
        return replay_floor([entry for entry in self._scan() if not self._foreign(entry)], self.keep_last, read_seq)

    def latest_stable(self) -> int | None:
        """The newest live STABLE step of this incarnation."""
        entries = self._scan(manifests=self.incarnation is not None)
        stable = [e.step for e in entries if STABLE in e.names and e.live and not self._foreign(e)]
        return max(stable, default=None)

    def load(self, step: int, store: ObjectStore | None = None) -> Checkpoint:
        """Step ``step`` from ``store``; without one, from the primary store or else the mirror.

        Raises CheckpointCorrupt when a part does not match its manifest, FileNotFoundError when
        the step is not there, ForeignCheckpoints when it is another incarnation's."""
        if store is None:
            if self.mirror is None:
                return self.load(step, self.store)
            try:
                return self.load(step, self.store)
            except UNREADABLE as error:
                log_event(
                    log,
                    Event.CHECKPOINT_SKIPPED,
                    level=logging.WARNING,
                    step=step,
                    store=self.store.url,
                    reason=str(error),
                )
                return self.load(step, self.mirror)
        prefix = self._prefix(step)
        manifest = Manifest.parse(store.get(prefix + MANIFEST))
        if manifest is None:
            raise CheckpointCorrupt(f"step {step}: manifest.json is not a manifest")
        if self._foreign(StoredStep(step, frozenset({MANIFEST}), manifest)):
            raise ForeignCheckpoints(
                f"step {step} at {store.url.rstrip('/')}/{prefix} belongs to another run incarnation "
                f"({manifest.incarnation}), not to {self.incarnation}",
                {self.location(store): [step]},
            )
        manifest.check_readable(f"{store.url.rstrip('/')}/{prefix}")
        parts = {}
        for name in manifest.files:
            data = store.get(prefix + name)
            manifest.verify(name, data)
            parts[name] = data
        return decode_checkpoint(step, manifest.read_back(parts))

    def load_latest(self, saved_step: int | None = None) -> Checkpoint | None:
        """The newest live step of this incarnation (of any, before it has one) whose parts all match its
        manifest, from the store or else its mirror; None when the run has never saved. See ``load_newest``."""
        return self.load_newest(saved_step).checkpoint

    def load_newest(self, saved_step: int | None = None) -> Resumable:
        """The newest loadable live step, and the newer steps passed over because a copy was corrupt.

        ``saved_step``: the step the run's own record says it saved last. Listing is retried with backoff; a
        store that still cannot be listed is never taken for an empty one (``resume_candidates`` raises
        StoreUnreadable or CheckpointsMissing). A step in an unknown format raises UnknownCheckpointFormat."""
        by_step = self._candidates(saved_step)
        stores = {store.url: store for store in (self.store, self.mirror) if store is not None}
        skipped: dict[int, str] = {}
        for step, urls in by_step.items():  # newest first
            unreachable = []
            for url in urls:
                try:
                    return Resumable(self.load(step, stores[url]), skipped)
                except UNREADABLE as error:  # this copy is bad: another copy, or an older step, may do
                    skipped[step] = f"{url}: {error}"[:500]
                    log_event(
                        log, Event.CHECKPOINT_SKIPPED, level=logging.WARNING, step=step, store=url, reason=str(error)
                    )
                except (UnknownCheckpointFormat, ForeignCheckpoints):
                    raise
                except Exception as error:  # the store failed mid-read: the step may be whole
                    unreachable.append(f"{url}: {error!r}"[:300])
            if unreachable:
                raise StoreUnreadable(f"cannot read step {step} ({'; '.join(unreachable)})")
        if by_step:  # the run saved, and no copy of any step loads: never a reason to start from base weights
            why = "; ".join(f"step {step}: {reason}" for step, reason in skipped.items())
            expected = f"; this run's record says it saved step {saved_step}" if saved_step is not None else ""
            raise CheckpointsMissing(f"no stored step of this run loads ({why}){expected}")
        return Resumable(None, skipped)

    def requested_resumes(self, saved_step: int | None = None) -> set[int]:
        """The requested resumes (``checkpoint.resume_step``) that the newest live step's copy of the lineage
        records, read without the rest of the step: a resume made on a run folder since lost (a new machine) is
        still known. The step is the one ``load_newest`` would try first, or the next whose copy reads; an empty
        set when the run never saved or no copy's lineage reads. Raises as ``load_newest`` lists."""
        stores = {store.url: store for store in (self.store, self.mirror) if store is not None}
        for step, urls in self._candidates(saved_step).items():  # newest first
            for url in urls:
                where = f"{url.rstrip('/')}/{self._prefix(step)}lineage.jsonl"
                try:
                    return requested_resumes(self._lineage_part(step, stores[url]), where)
                except UNREADABLE as error:  # LineageError is a ValueError: that copy's lineage does not read
                    log_event(
                        log, Event.CHECKPOINT_SKIPPED, level=logging.WARNING, step=step, store=url, reason=str(error)
                    )
        return set()

    def _lineage_part(self, step: int, store: ObjectStore) -> str:
        """The ``lineage.jsonl`` part of ``step`` on ``store``, checked against the step's manifest."""
        prefix = self._prefix(step)
        manifest = Manifest.parse(store.get(prefix + MANIFEST))
        if manifest is None:
            raise CheckpointCorrupt(f"step {step}: manifest.json is not a manifest")
        if "lineage.jsonl" not in manifest.files:
            raise CheckpointCorrupt(f"step {step}: its manifest lists no lineage.jsonl")
        data = store.get(prefix + "lineage.jsonl")
        manifest.verify("lineage.jsonl", data)
        return data.decode()

    def _candidates(self, saved_step: int | None) -> dict[int, list[str]]:
        """Step -> the urls of the stores to try it from, newest step first (``resume_candidates`` over both
        stores' listings, each retried)."""
        listings = []
        for store in (self.store, self.mirror):
            if store is None:
                continue
            try:
                live, abandoned = self._retried(self.run_id, lambda s=store: self.step_marks(s))
                listings.append(StoreListing(store.url, live, abandoned=abandoned))
            except Exception as error:  # the store's many failure types: it may hold steps all the same
                log_event(log, Event.STORE_UNREADABLE, level=logging.WARNING, store=store.url, reason=repr(error)[:300])
                listings.append(StoreListing(store.url, None, repr(error)[:300]))
        by_step: dict[int, list[str]] = {}
        for step, url in resume_candidates(listings, saved_step):
            by_step.setdefault(step, []).append(url)
        return by_step

    def version_high_water(self) -> int:
        """The highest policy version any stored step of this incarnation (abandoned ones too) says was served."""
        return max(
            (
                max(entry.manifest.version_high_water, entry.manifest.policy_version)
                for entry in self._retried(self.run_id, self._scan)
                if entry.manifest is not None and not self._foreign(entry)
            ),
            default=0,
        )
