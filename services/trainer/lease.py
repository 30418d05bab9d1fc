"""One trainer per run: a lease in the key-value bucket ``RLPIPE_<run>_LEASE`` (``transport.lease_bucket``), and its
fencing epoch.

The lease is one key (``trainer``) whose value names the holder, its epoch and when it expires. It is taken and
renewed only by compare-and-set on the key's revision (``kv.create`` when absent, ``kv.update(last=revision)``
otherwise), so of two trainers racing for it exactly one wins, and a holder whose revision moved on knows at its
next renewal that another took over. A lease not renewed within ``trainer.lease_ttl_s`` seconds may be taken. A
starting trainer that finds the lease held watches it: renewed meanwhile, its holder is alive and the start is
refused; left to expire (a SIGKILLed holder whose restart this is), it is taken then. A taker's epoch is one
above the highest it knows (the old lease's and ``floor``, the fence already in the store), so epochs only grow
even when the bucket was lost with its broker.

The epoch is what the store checks (``CheckpointStore.claim_fence``): a holder that was paused past its lease and
wakes after another took over finds a higher epoch there and writes nothing. Expiry is judged on wall-clock
times written into the value (one clock per machine; across machines, clocks must agree to well within the TTL).

The decisions are pure functions (``judge``, ``successor``) and the I/O stays in ``Lease``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.refusal import StartRefused

log = logging.getLogger(__name__)

KEY = "trainer"


class LeaseLost(RuntimeError):
    """This trainer no longer holds the run's lease: another took it over (``taken_over``), or it expired unrenewed
    (a pause, or a broker away for longer than the TTL: a restart may find nobody took it, and take it again)."""

    def __init__(self, message: str, taken_over: bool):
        super().__init__(message)
        self.taken_over = taken_over


@dataclass(frozen=True)
class LeaseRecord:
    """The value of the lease key."""

    holder: str  # host:pid of the trainer holding it
    epoch: int
    expires_at: float  # wall-clock seconds

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LeaseRecord:
        fields = json.loads(data)
        return cls(str(fields["holder"]), int(fields["epoch"]), float(fields["expires_at"]))


class Verdict(Enum):
    TAKE = "take"  # nobody holds it, or its holder let it expire
    REFUSE = "refuse"  # a live trainer holds it: it was written while this one watched
    WAIT = "wait"  # held, and not yet seen renewed: its holder may be dead (a SIGKILLed trainer being restarted)


def judge(
    current: LeaseRecord | None, revision: int, seen_revision: int | None, now: float, reaped: str = ""
) -> Verdict:
    """What a starting trainer does about the lease it reads at ``revision``, having first read ``seen_revision``.

    A held lease is not proof of a live holder: a trainer killed a moment ago leaves its lease until it expires, and
    its restart must take over then rather than be refused. A lease written since the first look is: its holder (or
    a trainer that took it meanwhile) renews it. ``reaped`` names a holder known dead (the launcher waited on its
    process): its lease is taken at once, and only while that holder still has it."""
    if current is None or current.expires_at <= now:
        return Verdict.TAKE
    if reaped and current.holder == reaped:
        return Verdict.TAKE
    if seen_revision is not None and revision != seen_revision:
        return Verdict.REFUSE
    return Verdict.WAIT


def successor(current: LeaseRecord | None, holder: str, floor: int, now: float, ttl_s: float) -> LeaseRecord:
    """The lease a starting trainer writes: an epoch above every one known, valid for ``ttl_s`` from ``now``."""
    known = max(current.epoch if current else 0, floor)
    return LeaseRecord(holder, known + 1, now + ttl_s)


def held_message(current: LeaseRecord, run_id: str, now: float) -> str:
    return (
        f"run {run_id} already has a live trainer: {current.holder} holds its lease (epoch {current.epoch}, "
        f"expires in {max(0.0, current.expires_at - now):.1f}s unless renewed); one trainer per run. "
        f"Stop that trainer first, or start this one under another run_id"
    )


class Lease:
    """The trainer's hold on its run: ``acquire`` at start, ``renew`` on its heartbeat, ``epoch`` for the store."""

    def __init__(
        self, kv: Any, run_id: str, ttl_s: float, clock: Callable[[], float] = time.time, reaped_holder: str = ""
    ):
        self.kv = kv
        self.run_id = run_id
        self.ttl_s = ttl_s
        self.reaped_holder = reaped_holder
        self.clock = clock
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.record: LeaseRecord | None = None
        self.revision = 0

    @property
    def epoch(self) -> int:
        if self.record is None:
            raise LeaseLost("the lease was never acquired", taken_over=False)
        return self.record.epoch

    def check(self) -> None:
        """LeaseLost unless this trainer's lease is still valid by its own clock: a write after the lease ran out
        could land after a successor took over but before it claimed the store's fence."""
        if self.record is None:
            raise LeaseLost("the lease was given up or never acquired", taken_over=False)
        now = self.clock()
        if self.record.expires_at <= now:
            raise LeaseLost(
                f"the lease of epoch {self.record.epoch} expired {now - self.record.expires_at:.1f}s ago",
                taken_over=False,
            )

    async def _read(self) -> tuple[LeaseRecord | None, int]:
        try:
            entry = await self.kv.get(KEY)
        except KeyNotFoundError:  # never written, or deleted by an operator: ``create`` takes it
            return None, 0
        return LeaseRecord.from_json(entry.value), entry.revision

    async def acquire(self, floor: int = 0) -> int:
        """Take the lease, or raise StartRefused naming its holder and when it expires; returns the epoch.

        While the lease is held and not seen renewed, waits (at most until it expires): a live holder renews it
        within a third of the TTL, a dead one lets it run out. ``floor`` is the highest epoch already known
        elsewhere (the store's fence)."""
        seen_revision: int | None = None
        while True:
            current, revision = await self._read()
            now = self.clock()
            verdict = judge(current, revision, seen_revision, now, self.reaped_holder)
            # (An absent lease is always taken: only a held one is refused or waited for.)
            if current is not None and verdict is Verdict.REFUSE:
                raise StartRefused(held_message(current, self.run_id, now))
            if current is not None and verdict is Verdict.WAIT:
                if seen_revision is None:
                    seen_revision = revision
                    log_event(log, Event.LEASE_WAITING, holder=current.holder, expires_in_s=current.expires_at - now)
                await asyncio.sleep(min(self.ttl_s / 6, current.expires_at - now))
                continue
            record = successor(current, self.holder, floor, now, self.ttl_s)
            try:
                if revision == 0:
                    self.revision = await self.kv.create(KEY, record.to_json())
                else:
                    self.revision = await self.kv.update(KEY, record.to_json(), last=revision)
            except KeyWrongLastSequenceError:  # another trainer took it between our read and write: judge it anew
                seen_revision = seen_revision if seen_revision is not None else revision
                continue
            self.record = record
            return record.epoch

    async def renew(self) -> None:
        """Extend the lease by ``ttl_s``; LeaseLost when it expired unrenewed or its revision moved on."""
        try:
            self.check()  # paused past it (SIGSTOP, a long GC): another may have taken it, and writes must stop
        except LeaseLost as expired:
            expired.taken_over = await self._moved_on()
            raise
        epoch = self.epoch
        record = LeaseRecord(self.holder, epoch, self.clock() + self.ttl_s)
        try:
            self.revision = await self.kv.update(KEY, record.to_json(), last=self.revision)
        except KeyWrongLastSequenceError:
            took = f"another trainer took over the lease from epoch {epoch}"
            raise LeaseLost(took, taken_over=True) from None
        self.record = record

    async def _moved_on(self) -> bool:
        """Whether the lease key was written since this holder's last write (another trainer took over)."""
        try:
            _, revision = await self._read()
        except Exception as error:  # the broker away: not known, so not claimed
            log_event(log, Event.LEASE_READ_FAILED, level=logging.WARNING, error=repr(error)[:200])
            return False
        return revision != self.revision

    async def release(self) -> None:
        """Give the lease up at a clean exit so that a successor need not wait out the TTL; only if still ours."""
        if self.record is None:
            return
        expired = LeaseRecord(self.holder, self.record.epoch, 0.0)
        self.record = None
        try:
            await self.kv.update(KEY, expired.to_json(), last=self.revision)
        except KeyWrongLastSequenceError:
            log_event(log, Event.LEASE_RELEASE_SKIPPED, level=logging.WARNING, reason="another trainer holds it now")
        except Exception as error:  # the broker away: the lease runs out by itself within ttl_s
            log_event(log, Event.LEASE_RELEASE_FAILED, level=logging.WARNING, error=repr(error)[:200])

    async def keep(self, on_lost: Callable[[LeaseLost], Awaitable[None]]) -> None:
        """Renew every third of the TTL until cancelled; ``on_lost`` once it is lost. A broker that does not answer
        is retried until the lease runs out, which then counts as lost."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self.renew()
            except LeaseLost as lost:
                await on_lost(lost)
                return
            except Exception as error:  # the broker away for a moment: the next renewal tries again, within the TTL
                log_event(log, Event.LEASE_RENEW_FAILED, level=logging.WARNING, error=repr(error)[:200])
