"""What became of every group the trainer fed: the bookkeeping exactly once rests on, with no I/O and no clock.

Exactly once rests here, not on the broker's duplicate window. ``GroupLedger`` knows the
fate of every group the current lineage fed: in flight until it is applied, dropped
(stale or disowned), filtered, dead-lettered or written off as lost. A group that already has a
fate is never fed again and never applied again, whatever the broker delivers: a feed
after the duplicate window expired, a compute repeated past it, a broker that restarted
without its dedupe entries. The ledger reaches back to the oldest kept checkpoint (it is
stored in every checkpoint), which is as far back as a resume can go. It forgets fates without forgetting
refusals: a group's id, ``e<epoch>-i<position>``, is its place in this incarnation's feeding order, and the
ledger keeps a "settled through" watermark (every group fed at or before it has a fate) plus the settled
groups above it, so a copy at or below the watermark is refused however late it comes, after its own fate
was dropped. The watermark is saved with the weights in every checkpoint and adopted with them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.trainer.intake.reader import Collected  # what settle_collected reads; intake imports this module


class Fate(StrEnum):
    APPLIED = "applied"
    DROPPED = "dropped"  # stale, or made by a policy version a resume or rollback disowned
    FILTERED = "filtered"  # rewards all equal, left out by dynamic sampling (train.dynamic_sampling)
    DEAD = "dead"
    LOST = "lost"


@dataclass
class Settled:
    step: int
    fate: Fate


_GROUP_ID = re.compile(r"e(\d+)-i(\d+)")


def feed_position(group_id: str) -> tuple[int, int] | None:
    """Where ``PromptFeeder`` fed ``group_id`` in its incarnation (epoch, position), or None for an id of another
    shape. Positions only grow as an incarnation feeds (a resume seeks back only to a cursor its checkpoint saved)."""
    match = _GROUP_ID.fullmatch(group_id)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def cursor_position(cursor: dict[str, int]) -> tuple[int, int]:
    """The feed position ``PromptFeeder``'s ``cursor`` feeds next (``feed_position``'s terms)."""
    return (cursor["epoch"], cursor["index"])


def feeding_order(group_id: str) -> tuple[int, int, str]:
    """Sort key putting group ids in the order ``PromptFeeder`` fed them (epoch, then position: ``e0-i2`` before
    ``e0-i10``, which a string sort puts the other way round); an id of another shape goes after, by its text."""
    match = _GROUP_ID.fullmatch(group_id)
    if match is None:
        return (2**63, 2**63, group_id)
    return (int(match.group(1)), int(match.group(2)), group_id)


@dataclass
class Flight:
    fed_at: float  # monotonic seconds
    serial: int  # feeding order: a group fed later has a higher one


class GroupLedger:
    """What became of every group the current lineage fed. Bookkeeping only: no I/O, no clock of its own."""

    def __init__(self) -> None:
        self.in_flight: dict[str, Flight] = {}
        # Read from EXPERIENCE into the batch being collected, not yet given a fate: no longer in flight (the
        # pipeline is done with them, so no slot and no age bound) unless the batch is dropped (``unread``), but a
        # checkpoint taken now must still list them, or a fed group would have no fate in it.
        self.read: set[str] = set()
        self.settled: dict[str, Settled] = {}
        self.repeats = 0  # deliveries of a group that already had its fate: never applied
        # Groups given a second chance by a re-inject. ``counts`` keeps each dead fate it recorded (a dead letter
        # happened), so a group dead, reopened and then applied is in both: fed = applied + dropped + filtered +
        # lost + (dead - reopened) + in flight + read.
        self.reopened = 0
        # "<stream>:<sequence>" of each message an operator re-injected from DEAD: a later dead letter of the same
        # message is a replay's (EXPERIENCE re-read after a resume), not a new failure of the reopened group.
        self.reinjected: set[str] = set()
        self.counts: Counter[Fate] = Counter()
        self.fed_count = 0
        self.newest_arrival = 0  # the highest serial that came back: the pipeline has moved past what is below
        # Every group this incarnation fed at or before this feed position has a fate, whether ``settled`` still
        # holds it or not: a copy of one is refused (unless it was reopened, and so is in flight or read).
        self.settled_through: tuple[int, int] | None = None
        # The feeder's cursor as a feed position (``Intake.feed`` sets it after each feed): no group at or past it
        # was fed unless it is in flight or read, so the watermark stays below it. A feed whose publishes landed
        # out of order seeks back to the first that failed; one after it that landed may settle before the failed
        # one is fed again, and a watermark past the failed one would skip it as known.
        self.unfed_from: tuple[int, int] | None = None

    def fate(self, group_id: str) -> Fate | None:
        settled = self.settled.get(group_id)
        return None if settled is None else settled.fate

    def dead(self) -> list[str]:
        """The settled groups whose fate is dead, for a checkpoint: a re-inject after a resume may still reopen them."""
        return sorted(g for g, s in self.settled.items() if s.fate == Fate.DEAD)

    def known(self, group_id: str) -> bool:
        return group_id in self.in_flight or group_id in self.read or group_id in self.settled or self.covered(group_id)

    def covered(self, group_id: str) -> bool:
        """Whether ``group_id`` is at or below the watermark: fed by this incarnation and given a fate."""
        position = feed_position(group_id)
        return position is not None and self.settled_through is not None and position <= self.settled_through

    def advance(self) -> None:
        """Move the watermark up to the newest settled group below every group still without a fate. A fed group
        above the watermark has its fate in ``settled`` or none yet, so every one below that bound has a fate.
        A group reopened below the watermark does not hold it back: it is in flight, which ``arrived`` asks first."""

        floor = self.settled_through

        def above(group_ids: Iterable[str]) -> list[tuple[int, int]]:
            positions = (feed_position(g) for g in group_ids)
            return [p for p in positions if p is not None and (floor is None or p > floor)]

        unfed = [] if self.unfed_from is None else [self.unfed_from]
        bound = min(above(self.in_flight.keys() | self.read) + unfed, default=None)
        below = [p for p in above(self.settled) if bound is None or p < bound]
        if below:
            self.settled_through = max(below)

    def exceptions(self) -> list[str]:
        """The settled groups a checkpoint lists beside the watermark: those above it, and every dead one (a
        re-inject may reopen it however old it is)."""
        return sorted(g for g, s in self.settled.items() if s.fate == Fate.DEAD or not self.covered(g))

    def watermark(self) -> str:
        """The watermark as the id of the group at it, as checkpoints keep it; "" when there is none yet."""
        return "" if self.settled_through is None else "e{}-i{}".format(*self.settled_through)

    def unsettled(self) -> list[str]:
        """Fed groups without a fate yet, for a checkpoint: in flight, or read and waiting for their step. A
        resumed trainer counts them all in flight; those already read come again from EXPERIENCE, which keeps
        everything after the checkpoint's sequence."""
        return sorted(self.in_flight.keys() | self.read, key=feeding_order)

    def fed(self, group_id: str, now: float) -> None:
        self.fed_count += 1
        self.in_flight[group_id] = Flight(now, self.fed_count)

    def arrived(self, group_id: str) -> bool:
        """A group came out of EXPERIENCE: True if it may be used, False for a repeat of a settled one."""
        unsettled = group_id in self.in_flight or group_id in self.read
        if group_id in self.settled or (not unsettled and self.covered(group_id)):
            self.repeats += 1
            return False
        flight = self.in_flight.pop(group_id, None)
        if flight is not None:
            self.newest_arrival = max(self.newest_arrival, flight.serial)
        self.read.add(group_id)
        return True

    def settle(self, group_ids: list[str], step: int, fate: Fate) -> list[str]:
        """Give each group its fate (once); returns those that had none yet. One under the watermark and neither in
        flight nor read has its fate, forgotten: a dead letter of another copy of it must not settle it again (a
        re-inject would then reopen it, and apply it a second time: the recovery simulation's seed 450)."""
        new = [
            g
            for g in group_ids
            if g not in self.settled and (g in self.in_flight or g in self.read or not self.covered(g))
        ]
        for group_id in new:
            self.in_flight.pop(group_id, None)
            self.read.discard(group_id)
            self.settled[group_id] = Settled(step, fate)
            self.counts[fate] += 1
        return new

    def settle_collected(self, collected: Collected, step: int) -> None:
        """The fates of a batch that ``step`` trained on: its groups applied, those left out dropped or filtered."""
        self.settle([g.group_id for g in collected.batch], step, Fate.APPLIED)
        self.settle(collected.dropped, step, Fate.DROPPED)
        self.settle(collected.filtered, step, Fate.FILTERED)

    def reopen(self, group_id: str, now: float) -> bool:
        """A dead group re-injected by the operator: in flight again (fed last, its clock starting ``now``), so its
        copy is applied once when it comes, or written off as lost if it never does. A dead fate reopens, and so
        does no fate at all (forgotten with the checkpoint it was settled before, or a fixed body naming a group
        never fed), whose copy would be taken anyway: in flight, it is at least accounted for. A group applied,
        dropped or lost meanwhile keeps its fate, one in flight or read stays so, and a copy of it is refused."""
        fate = self.fate(group_id)
        unsettled = group_id in self.in_flight or group_id in self.read
        # Dead fates are never forgotten, so one at or below the watermark with none in ``settled`` was not dead.
        if fate != Fate.DEAD and (fate is not None or unsettled or self.covered(group_id)):
            return False
        self.settled.pop(group_id, None)
        self.fed_count += 1
        self.in_flight[group_id] = Flight(now, self.fed_count)
        self.reopened += 1
        return True

    def unread(self, now: float) -> None:
        """The batch being collected was dropped (an interrupt, a failure): its groups are read again from
        EXPERIENCE and are in flight until then, their clocks starting ``now`` and counted as fed before any group
        in flight (serial 0: the pipeline already took them through once). One whose message is gone by then (a
        broker back without its unsynced writes, the recovery simulation's seed 84) is written off as lost once
        overdue, rather than left read, with no fate, for good."""
        for group_id in self.read:
            self.in_flight[group_id] = Flight(now, 0)
        self.read.clear()

    def overdue(self, now: float, max_age_s: float) -> list[str]:
        """Groups in flight longer than ``max_age_s`` that a group fed after them has overtaken. A group nothing
        overtook waits with the rest of a stalled pipeline (a slow start, a role down): the stall alerts report
        that, and writing the groups off would only feed more into the same stall."""
        return sorted(
            g
            for g, flight in self.in_flight.items()
            if now - flight.fed_at > max_age_s and flight.serial < self.newest_arrival
        )

    def forget_through(self, step: int) -> None:
        """Drop the fates settled before ``step`` (the oldest kept checkpoint, which a rollback may go back to and
        which lists them) that the watermark refuses for them; dead fates stay, for a re-inject to reopen."""
        self.advance()
        self.settled = {
            g: s for g, s in self.settled.items() if s.step >= step or s.fate == Fate.DEAD or not self.covered(g)
        }

    def restore(
        self,
        in_flight: list[str],
        applied: list[str],
        dead: list[str],
        reinjected: list[str],
        step: int,
        now: float,
        settled_through: str = "",
    ) -> None:
        """Adopt a checkpoint's ledger: its in-flight groups (their clocks start now, their serials in feeding order,
        whatever order an older checkpoint listed them in), its watermark, the groups it settled besides (``applied``
        lists every one; those also in ``dead`` keep that fate, which a re-inject reopens) and the messages
        re-injected."""
        self.reinjected = set(reinjected)
        ordered = sorted(in_flight, key=feeding_order)
        self.in_flight = {g: Flight(now, serial) for serial, g in enumerate(ordered, start=1)}
        self.read = set()
        self.fed_count, self.newest_arrival = len(in_flight), 0
        self.settled = {g: Settled(step, Fate.APPLIED) for g in applied} | {g: Settled(step, Fate.DEAD) for g in dead}
        self.settled_through = feed_position(settled_through)
        self.unfed_from = None  # until the next feed says where the feeder, sought to the checkpoint, goes on from

    def rewind(
        self,
        applied: list[str],
        step: int,
        now: float,
        settled_through: str = "",
        abandoned: Iterable[str] = (),
        dead: Iterable[str] = (),
    ) -> list[str]:
        """A rollback to a checkpoint: its applied and dropped groups stand. Dead and lost groups stay settled
        (they are facts about the pipeline, not the model) and groups in flight stay in flight. A group applied or
        dropped after the checkpoint loses that fate and is in flight again, so it keeps exactly one: applied anew
        when EXPERIENCE is re-read, or, its message purged, written off as lost once overdue. Their clocks start
        now, and they count as fed before any group in flight (serial 0): the pipeline already took them through
        once. ``abandoned``: the groups the abandoned steps applied or dropped as the lineage records them, since
        the ledger may have forgotten their fates below its watermark (the recovery simulation's seed 151).

        ``dead``: the checkpoint's dead groups. One that is not dead here was re-injected since (its dead fate
        reopened by an operator, a fact about the pipeline that the rollback keeps): the checkpoint's fate does not
        stand for it. In flight (or read), it stays so (seed 923); settled since by a step the rollback abandons, it
        is reopened like that step's other groups (seed 65).

        The higher of the checkpoint's watermark and this ledger's stands: every group under this one has a fate
        the rollback keeps, or was settled by a step it abandons and is in flight again. The checkpoint's lower one
        would forget a lost group this ledger knows only by its watermark (a resume from a later checkpoint, then a
        rollback: seed 151 again). Returns the reopened groups in feeding order."""
        unsettled = self.in_flight.keys() | self.read
        reinjected = {g for g in dead if self.fate(g) != Fate.DEAD}
        checkpoint = GroupLedger()
        checkpoint.settled = {
            g: Settled(step, Fate.APPLIED) for g in applied if g not in unsettled and g not in reinjected
        }
        checkpoint.settled_through = feed_position(settled_through)
        kept = {g: s for g, s in self.settled.items() if s.fate in (Fate.DEAD, Fate.LOST)}
        undone = sorted(
            (
                g
                for g in (self.settled.keys() | set(abandoned)) - kept.keys() - unsettled
                if not checkpoint.known(g) or g in reinjected
            ),
            key=feeding_order,
        )
        self.settled = checkpoint.settled | kept
        self.settled_through = max(filter(None, (checkpoint.settled_through, self.settled_through)), default=None)
        for group_id in undone:
            self.in_flight[group_id] = Flight(now, 0)
        return undone
