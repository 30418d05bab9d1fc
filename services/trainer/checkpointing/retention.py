"""Retention: which stored steps stay, and what no kept step would read again (purged).

The policy is pure (``prunable``, ``replay_floor``): stored steps in, steps or a sequence out. ``CheckpointStore``
prunes by it after each save; ``Purger`` drops, after a save, the EXPERIENCE (and claim-checked bodies) that no
kept checkpoint would re-read, and the ledger forgets the fates settled before the oldest kept step that its
watermark refuses for them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.transport.bus import Bus
from services.common.transport.streams import EXPERIENCE, stream_name
from services.trainer.checkpointing.manifest import STABLE, StoredStep
from services.trainer.intake.ledger import GroupLedger
from services.trainer.progress import ConfigSource, Progress

if TYPE_CHECKING:  # checkpoint.py prunes by this module's policy
    from services.trainer.checkpointing.store import CheckpointStore

log = logging.getLogger(__name__)


def prunable(own: list[StoredStep], keep_last: int) -> list[int]:
    """The steps of ``own`` (one incarnation's, oldest first) that pruning deletes: all but the newest ``keep_last``
    live steps and every live stable one; abandoned steps go first."""
    live = [entry.step for entry in own if entry.live]
    keep = set(live[-keep_last:]) | {entry.step for entry in own if STABLE in entry.names and entry.live}
    return [entry.step for entry in own if entry.step not in keep]


def replay_floor(own: list[StoredStep], keep_last: int, read_seq: int) -> int | None:
    """The EXPERIENCE sequence at and below which nothing is ever read again, never above ``read_seq`` (what the
    trainer has read): the lowest sequence applied by the newest ``keep_last`` live steps of ``own`` (one
    incarnation's, oldest first), the ones a resume or a rollback within the kept window reads on from; ``read_seq``
    when there are none.

    A STABLE step older than that window does not hold EXPERIENCE back (a run would keep its stream forever): a
    rollback to it reads on from the purge (``purged_through``). None when a step of the window has no known
    sequence."""
    window = [entry for entry in own if entry.live][-keep_last:]
    seqs = [entry.manifest.last_experience_seq if entry.manifest is not None else None for entry in window]
    known = [seq for seq in seqs if seq is not None]
    if len(known) < len(seqs):
        return None
    return min([*known, read_seq])


class Purger:
    """Drops what no kept checkpoint would re-read, and remembers the claim-checked bodies read until then."""

    def __init__(
        self, settings: ConfigSource, checkpoints: CheckpointStore, progress: Progress, ledger: GroupLedger, bus: Bus
    ):
        self.settings = settings
        self.checkpoints = checkpoints
        self.progress = progress
        self.ledger = ledger
        self.bus = bus
        self.claim_keys: dict[str, int] = {}  # claim-checked EXPERIENCE bodies read, key -> sequence
        self.purged_seq = 0  # EXPERIENCE purged through here by this process

    def track_claims(self, claim_keys: list[tuple[int, str]]) -> None:
        self.claim_keys |= {key: seq for seq, key in claim_keys}

    async def read_on_after(self, seq: int) -> int:
        """Where to read EXPERIENCE on from for a state that read through ``seq``: there, or past this run's purge
        when it went further (a rollback to a STABLE step older than the kept window, a resume after checkpoints
        were off). The groups in between are gone on purpose; those the state still had in flight are written off
        as lost once overdue (``train.lost_after_s``), like any group that never comes back."""
        created = await self.bus.stream_created(EXPERIENCE)
        purged = await asyncio.to_thread(self.checkpoints.purged_through, str(created))
        if purged <= seq:
            return seq
        log_event(log, Event.REPLAY_PURGED, level=logging.WARNING, read_through=seq, purged_through=purged)
        return purged

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
            log_event(log, Event.PURGE_FAILED, level=logging.WARNING, error=repr(error)[:300])
            return
        self.purged_seq = floor
        for key in doomed:
            self.claim_keys.pop(key, None)
        if oldest is not None:
            self.ledger.forget_through(oldest)
        log_event(log, Event.PURGED, experience_below=floor + 1, claims=len(doomed))
