"""A run's prefix on an object store, as every checkpoint operation reaches it: retried calls, the lease fence
checked before each write, the listing of step folders with their manifests, and the note of how far the run
purged EXPERIENCE, kept beside them.

``CheckpointStore`` (checkpoint.py) builds saving, loading and marking on it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.transport.lifecycle_tags import CHECKPOINT_TAG
from services.common.transport.storage import ObjectStore
from services.trainer.checkpointing.manifest import (
    FENCE,
    MANIFEST,
    PURGED,
    STEP_FILE,
    Manifest,
    StoredStep,
    step_prefix,
)

log = logging.getLogger(__name__)


class FencedOut(RuntimeError):
    """A trainer of a higher lease epoch claimed this run's prefix: this one's writes are refused."""


class StepStore:
    """Steps on a store and its mirror, owned by one run incarnation and written under one lease epoch."""

    def __init__(
        self,
        store: ObjectStore,
        run_id: str,
        keep_last: int,
        attempts: int = 4,
        backoff_s: float = 1.0,
        mirror: ObjectStore | None = None,
        incarnation: str | None = None,
        compression: str = "none",
    ):
        """``compression``: checkpoint.compression, how the weights and optimizer state of a save are stored
        (every step loads whichever way it was stored)."""
        self.store = store
        self.compression = compression
        self.mirror = mirror
        self.run_id = run_id
        self.keep_last = keep_last
        self.attempts = attempts
        self.backoff_s = backoff_s
        # None until the trainer has decided: start_fresh() or adopt_incarnation() (or a restart that knows it).
        self.incarnation = incarnation
        # The lease epoch this writer holds (claim_fence); None: a writer without a lease, never fenced.
        self.epoch: int | None = None
        # Raises when the writer's own lease has run out (Lease.check); called before the store's fence is read.
        self.guard: Callable[[], None] | None = None

    def location(self, store: ObjectStore | None = None) -> str:
        """The run's prefix on ``store``: ``<url>/<run_id>/``."""
        return f"{(store or self.store).url.rstrip('/')}/{self.run_id}/"

    def _foreign(self, entry: StoredStep) -> bool:
        owner = entry.owner
        return self.incarnation is not None and owner is not None and owner != self.incarnation

    # -- store access ---------------------------------------------------------------------

    def _retried(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` with retries and exponential backoff: object stores fail transiently."""
        for attempt in range(1, self.attempts + 1):
            try:
                return call()
            except FileNotFoundError:
                raise  # an answer, not a transient failure
            except Exception as error:  # network and S3 errors come in many types
                if attempt == self.attempts:
                    raise
                delay = self.backoff_s * 2 ** (attempt - 1)
                log_event(
                    log,
                    Event.STORE_RETRY,
                    level=logging.WARNING,
                    key=what,
                    attempt=attempt,
                    retry_s=delay,
                    error=repr(error)[:300],
                )
                time.sleep(delay)

    def _put(self, key: str, data: bytes, store: ObjectStore | None = None, tags: dict[str, str] | None = None) -> None:
        self._check_fence()
        self._retried(key, lambda: (store or self.store).put(key, data, tags))

    def _delete(self, keys: list[str], store: ObjectStore) -> None:
        if keys:
            self._check_fence()
            self._retried(keys[0], lambda: store.delete(keys))

    # -- fencing --------------------------------------------------------------------------

    @property
    def _fence_key(self) -> str:
        return f"{self.run_id}/{FENCE}"

    def stored_fence(self) -> int:
        """The highest lease epoch that claimed this prefix on the primary store; 0 when none did."""
        try:
            data = self._retried(self._fence_key, lambda: self.store.get(self._fence_key))
        except FileNotFoundError:
            return 0
        return int(json.loads(data)["epoch"])

    def claim_fence(self, epoch: int, holder: str) -> None:
        """Make ``epoch`` this prefix's fence: from then on every write of a lower epoch is refused (FencedOut).

        Raises FencedOut when the store already names a higher epoch. Written before anything else the trainer
        writes, so a successor's first write is its claim."""
        self.epoch = epoch
        self._check_fence()
        note = json.dumps({"epoch": epoch, "holder": holder, "time": time.time()}).encode()
        self._retried(self._fence_key, lambda: self.store.put(self._fence_key, note))

    def record_purge(self, seq: int, stream: str) -> None:
        """Note, before EXPERIENCE is purged through ``seq``, that this run purges it: a resume or rollback to a step
        that read less then reads on after ``seq`` instead of taking the gap for a broker that lost messages.

        ``stream`` names the stream's life (its creation time): a stream re-created since voids the note. Written to
        the mirror too, as a checkpoint is, so that a resume from the mirror knows it."""
        data = json.dumps({"experience_seq": seq, "stream": stream}).encode()
        self._put(self._purge_key, data)
        if self.mirror is not None:
            try:
                self._put(self._purge_key, data, self.mirror)
            except Exception as error:  # the primary holds the truth
                log_event(log, Event.MIRROR_FAILED, level=logging.WARNING, key=self._purge_key, error=repr(error)[:300])

    def purged_through(self, stream: str) -> int:
        """The EXPERIENCE sequence through which this run purged ``stream`` (its life as in ``record_purge``);
        0 when it never did. Read from the primary store, or from the mirror while the primary is unreachable."""
        stores = [self.store] if self.mirror is None else [self.store, self.mirror]
        for store in stores:
            try:
                data = self._retried(self._purge_key, lambda store=store: store.get(self._purge_key))
            except FileNotFoundError:
                return 0
            except Exception:
                if store is stores[-1]:
                    raise
                continue
            record = json.loads(data)
            return int(record["experience_seq"]) if record.get("stream") == stream else 0
        return 0

    @property
    def _purge_key(self) -> str:
        return f"{self.run_id}/{PURGED}"

    def _check_fence(self) -> None:
        """Refuse a write when the store's fence is above this writer's epoch (a successor took the run over).

        Checked on the store before each write, not from the writer's belief. Object stores offer no
        compare-and-set everywhere, so the check and the write are two requests: a writer paused between them
        can still land that one write; every later one is refused."""
        if self.guard is not None:
            self.guard()
        if self.epoch is None:
            return
        stored = self.stored_fence()
        if stored > self.epoch:
            log_event(log, Event.FENCED_OUT, level=logging.CRITICAL, alert=True, epoch=self.epoch, fence=stored)
            raise FencedOut(
                f"a trainer of lease epoch {stored} took over run {self.run_id}; this one (epoch {self.epoch}) "
                f"writes nothing more to {self.location()}"
            )

    def _prefix(self, step: int) -> str:
        return step_prefix(self.run_id, step)

    def _put_in_step(self, key: str, data: bytes, store: ObjectStore | None = None) -> None:
        """Put an object of a step (a part, the manifest, a marker), tagged for the bucket's checkpoint rule."""
        self._put(key, data, store, dict([CHECKPOINT_TAG]))

    def _listing(self, store: ObjectStore | None = None) -> dict[int, set[str]]:
        """Step -> which of manifest, STABLE and ABANDONED it has."""
        found: dict[int, set[str]] = {}
        for key in (store or self.store).list(f"{self.run_id}/step-"):
            match = STEP_FILE.search(key)
            if match:
                found.setdefault(int(match.group(1)), set()).add(match.group(2))
        return found

    def _scan(self, store: ObjectStore | None = None, manifests: bool = True) -> list[StoredStep]:
        """The steps with a manifest on ``store``, oldest first; with ``manifests``, each with its manifest read.

        A step pruned between the listing and the read of its manifest is left out."""
        store = store or self.store
        entries = []
        for step, names in sorted(self._listing(store).items()):
            if MANIFEST not in names:
                continue
            manifest = None
            if manifests:
                try:
                    manifest = Manifest.parse(store.get(self._prefix(step) + MANIFEST))
                except FileNotFoundError:
                    continue
            entries.append(StoredStep(step, frozenset(names), manifest))
        return entries
