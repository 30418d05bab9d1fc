"""The trainer's intake: it feeds PROMPTS and reads EXPERIENCE in stream order.

Exactly once rests here, not on the broker's duplicate window. ``GroupLedger`` knows the
fate of every group the current lineage fed: in flight until it is applied, dropped
(stale or disowned), dead-lettered or written off as lost. A group that already has a
fate is never fed again and never applied again, whatever the broker delivers: a feed
after the duplicate window expired, a compute repeated past it, a broker that restarted
without its dedupe entries. The ledger reaches back to the oldest kept checkpoint (it is
stored in every checkpoint), which is as far back as a resume can go. It forgets fates without forgetting
refusals: a group's id, ``e<epoch>-i<position>``, is its place in this incarnation's feeding order, and the
ledger keeps a "settled through" watermark (every group fed at or before it has a fate) plus the settled
groups above it, so a copy at or below the watermark is refused however late it comes, after its own fate
was dropped. The watermark is saved with the weights in every checkpoint and adopted with them.

Slots are reconciled, not only counted: dead letters are read from the DEAD stream by
sequence (none is missed while the trainer reconnects or is down; the sequence read through is
kept in checkpoints, so a resumed trainer reads on after it), only this incarnation's letters
settle groups, and a re-inject record there (``rlpipe dead-letters --reinject``) reopens the
group it names, which is then in flight again until its copy comes back. A group that has
been in flight for ``train.lost_after_s``, that a group fed after it has overtaken, and
that is not waiting unread in EXPERIENCE, is recorded as lost and its slot freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from services.common.config import RunConfig
from services.common.model.datasets import Fed, PromptSource, RowTable
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.observe.telemetry import span_from_headers
from services.common.transport.breaker import CircuitBreaker
from services.common.transport.bus import Bus
from services.common.transport.claims import StoreUnavailable
from services.common.transport.messages import DecodeError, ExperienceGroup, Prompt, dedupe_id
from services.common.transport.reader import StreamReader
from services.common.transport.streams import (
    DEAD,
    EXPERIENCE,
    H_GROUP,
    H_INCARNATION,
    H_REINJECTED,
    H_SEQ,
    H_STREAM,
    PROMPTS,
    StreamMessage,
    stream_name,
)
from services.trainer.progress import Progress

log = logging.getLogger(__name__)
LOST_CHECK_S = 1.0  # how often groups in flight are checked against train.lost_after_s
# Dynamic sampling that has filtered this many batches' worth of groups while filling one batch alerts: the task is
# too easy or too hard for the policy (every group all right or all wrong), and the step may never come.
FILTERED_ALERT_BATCHES = 10


class PromptFeeder:
    """Walks the dataset epoch by epoch in a seeded order; its cursor is (epoch, index), index being how far into
    the epoch's order it is. ``source`` is a list of rows or any ``PromptSource`` (services/common/model/datasets.py:
    rows in memory, a memory-mapped dataset, a stream): the order depends only on the seed and the epoch, so a
    feeder that seeks a saved cursor feeds what the one that saved it would have fed next."""

    def __init__(self, source: list[dict[str, Any]] | PromptSource, seed: int, shuffle: bool):
        self.source = RowTable(source) if isinstance(source, list) else source
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._walk = self.source.walk(0, 0, seed, shuffle)
        # The last prompt, the cursor before it and the walk after it: a seek one prompt back (a publish that
        # failed) replays it instead of reading a stream up to it again.
        self._last: tuple[dict[str, int], Prompt, tuple[int, int, Iterator[Fed]]] | None = None
        self._replay: tuple[Prompt, tuple[int, int, Iterator[Fed]]] | None = None

    def next(self) -> Prompt:
        before = self.cursor
        if self._replay is not None:
            prompt, (self.epoch, self.index, self._walk) = self._replay
            self._replay = None
        else:
            prompt = self._next_row()
        self._last = (before, prompt, (self.epoch, self.index, self._walk))
        return prompt

    def _next_row(self) -> Prompt:
        epochs_ended = 0
        while True:
            fed = next(self._walk, None)
            if fed is None:  # the epoch is over: the next one, in its own order
                epochs_ended += 1
                if epochs_ended > 1:  # a whole epoch went by without a row to feed (streamed rows all bad)
                    raise ValueError("the dataset has no usable row to feed")
                self.epoch, self.index = self.epoch + 1, 0
                self._walk = self.source.walk(self.epoch, 0, self.seed, self.shuffle)
                continue
            self.index = fed.position + 1
            if fed.row is not None:
                break
        return Prompt(
            group_id=f"e{self.epoch}-i{fed.position}",
            prompt_id=str(fed.row.get("id", fed.index)),
            prompt=fed.row["prompt"],
            answer=str(fed.row.get("answer", "")),
        )

    @property
    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, cursor: dict[str, int]) -> None:
        if self._last is not None and cursor == self._last[0]:
            self._replay = self._last[1:]
        else:
            self._replay = None
            self._walk = self.source.walk(cursor["epoch"], cursor["index"], self.seed, self.shuffle)
        self.epoch, self.index = cursor["epoch"], cursor["index"]


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
        # pipeline is done with them, so no slot and no age bound), but a checkpoint taken now must still list
        # them, or a fed group would have no fate in it.
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

        bound = min(above(self.in_flight.keys() | self.read), default=None)
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
        """Give each group its fate (once); returns those that had none yet."""
        new = [g for g in group_ids if g not in self.settled]
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

    def rewind(
        self, applied: list[str], step: int, now: float, settled_through: str = "", abandoned: Iterable[str] = ()
    ) -> list[str]:
        """A rollback to a checkpoint: only its watermark and its applied and dropped groups stand. Dead and lost
        groups stay settled (they are facts about the pipeline, not the model) and groups in flight stay in
        flight. A group applied or dropped after the checkpoint loses that fate and is in flight again, so it
        keeps exactly one: applied anew when EXPERIENCE is re-read, or, its message purged, written off as lost
        once overdue. Their clocks start now, and they count as fed before any group in flight (serial 0): the
        pipeline already took them through once. ``abandoned``: the groups the abandoned steps applied or dropped
        as the lineage records them, since the ledger may have forgotten their fates below its watermark (the
        recovery simulation's seed 151). A group the checkpoint holds settled that is in flight now was re-injected
        since (its dead fate reopened by an operator, a fact about the pipeline): it stays in flight (seed 923).
        Returns the reopened groups in feeding order."""
        checkpoint = GroupLedger()
        checkpoint.settled = {g: Settled(step, Fate.APPLIED) for g in applied if g not in self.in_flight}
        checkpoint.settled_through = feed_position(settled_through)
        kept = {g: s for g, s in self.settled.items() if s.fate in (Fate.DEAD, Fate.LOST)}
        undone = sorted(
            (
                g
                for g in (self.settled.keys() | set(abandoned)) - kept.keys() - self.in_flight.keys()
                if not checkpoint.known(g)
            ),
            key=feeding_order,
        )
        self.settled = checkpoint.settled | kept
        self.settled_through = checkpoint.settled_through
        for group_id in undone:
            self.in_flight[group_id] = Flight(now, 0)
        return undone


@dataclass
class Collected:
    """One step's worth of EXPERIENCE: the groups to train on, those dropped or filtered, and how far it read."""

    batch: list[ExperienceGroup]
    dropped: list[str]
    sequence: int  # the last EXPERIENCE sequence read for this batch
    claim_keys: list[tuple[int, str]] = field(default_factory=list)  # claim-checked bodies read, by sequence
    filtered: list[str] = field(default_factory=list)  # groups without signal, left out by dynamic sampling

    @property
    def filtered_fraction(self) -> float:
        """The share of the usable groups read for this batch that dynamic sampling left out."""
        return len(self.filtered) / max(len(self.batch) + len(self.filtered), 1)


def without_signal(group: ExperienceGroup) -> bool:
    """Whether every completion of ``group`` got the same reward: a group baseline gives each advantage 0, so the
    group would add tokens to the step and nothing to its gradient (DAPO's dynamic sampling leaves it out). A group
    of one completion has no group baseline and is kept."""
    return len(group.rewards) > 1 and bool(np.all(group.rewards == group.rewards[0]))


def token_id_problem(group: ExperienceGroup, vocab_size: int) -> str | None:
    """Why ``group``'s token ids would break the learner, or None. They index its embedding: each must be an integer
    in ``[0, vocab_size)``. Decoding cannot tell (it knows no model), and a float or an id past the vocabulary that
    reached a step would fail it, and every restart's replay of it, instead of going to DEAD."""
    named = [("prompt_ids", group.prompt_ids)]
    named += [(f"completion {i} token_ids", c.token_ids) for i, c in enumerate(group.completions)]
    for name, ids in named:
        if not np.issubdtype(ids.dtype, np.integer):
            return f"{name} are {ids.dtype.name}, not integers"
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            return f"{name} range over {ids.min()}..{ids.max()}, outside the model's vocabulary 0..{vocab_size - 1}"
    return None


class Intake:
    """Feeds prompts up to the in-flight limit and collects batches from EXPERIENCE."""

    def __init__(
        self,
        bus: Bus,
        feeder: PromptFeeder,
        ledger: GroupLedger,
        progress: Progress,
        on_lost: Callable[[list[str]], Awaitable[None]],
        on_reopened: Callable[[str, int], None],
        vocab_size: int,
    ):
        self.bus = bus
        self.feeder = feeder
        self.ledger = ledger
        self.progress = progress
        self.on_lost = on_lost  # records groups written off as lost (lineage, metrics, alerts)
        self.on_reopened = on_reopened  # records a re-injected group (its id, the DEAD letter's sequence)
        self.vocab_size = vocab_size  # the learner's embedding rows: a token id must index one
        self.reader: StreamReader | None = None
        self.dead: StreamReader | None = None  # DEAD on after progress.dead_seq (or its oldest letter still kept)
        self.lost_checked = 0.0
        # The broker calls below that nothing else retries (DEAD's first look-up, the write-off's look at
        # EXPERIENCE, a dead letter): a failure skips or holds that work and backs off before the next try.
        self.broker = CircuitBreaker()

    def rewind(self) -> None:
        """Read EXPERIENCE again after the last applied sequence: after a restore, a rollback, or a dropped batch."""
        self.reader = self.bus.read_from(EXPERIENCE, self.progress.applied_seq + 1)

    async def feed(self, cfg: RunConfig, config_version: int, accepted: int = 0) -> None:
        """Top PROMPTS up to the in-flight bound. Synchronous (``train.synchronous``), the bound is one batch
        counting the ``accepted`` groups of the batch being collected, so nothing is fed for the next step until
        this one is trained (a group dropped as stale frees its slot for a fresh one), and each prompt asks for
        the version just published."""
        synchronous = cfg.train.synchronous
        limit = cfg.train.batch_size if synchronous else cfg.train.max_inflight_batches * cfg.train.batch_size
        while len(self.ledger.in_flight) + (accepted if synchronous else 0) < limit:
            cursor = self.feeder.cursor
            prompt = self.feeder.next()
            if self.ledger.known(prompt.group_id):
                continue  # settled before a restart (dead-lettered, say): feeding it again would apply it twice
            prompt.config_version = config_version
            prompt.incarnation = self.progress.incarnation
            prompt.min_policy_version = self.progress.version if synchronous else 0
            try:
                ack = await self.bus.publish(PROMPTS, prompt, msg_id=dedupe_id(prompt, "prompt"))
            except (NatsError, TimeoutError) as error:
                self.feeder.seek(cursor)  # publish it again later; a copy that did land is deduplicated
                log_event(
                    log, Event.FEED_FAILED, level=logging.WARNING, group_id=prompt.group_id, error=repr(error)[:300]
                )
                return
            if ack.duplicate:
                # Fed before a restart inside the duplicate window: it is somewhere downstream (or in DEAD, which
                # catch_up_dead settles), so it is in flight; the lost-group bound frees the slot if it never comes.
                log_event(log, Event.FEED_REPEATED, group_id=prompt.group_id)
            self.ledger.fed(prompt.group_id, time.monotonic())

    async def catch_up_dead(self) -> int:
        """Settle every group this incarnation's dead letters name since the last look, as dead, and reopen those
        re-injected since; returns how many were newly settled as dead. With the broker away it does nothing and
        the next look (backed off) goes on from where this one would have."""
        if self.dead is None:
            if self.broker.retry_in() > 0:
                return 0
            try:
                info = await self.bus.js.stream_info(stream_name(self.bus.run_id, DEAD))
            except (NatsError, TimeoutError) as error:
                self._broker_failed("dead_lookup", error)
                return 0
            self.broker.succeeded()
            self.dead = self.bus.read_from(DEAD, max(info.state.first_seq, self.progress.dead_seq + 1))
        new = 0
        while (msg := await self.dead.next(timeout=0)) is not None:
            self.progress.read_dead(msg.sequence)
            new += self._read_dead(msg)
        return new

    def _read_dead(self, msg: StreamMessage) -> int:
        """Act on one DEAD message: 1 when it settled a group as dead, else 0."""
        headers = msg.headers or {}
        group_id = headers.get(H_GROUP)
        if not group_id:
            return 0
        if not self._ours(headers):
            # An abandoned incarnation's group: this one feeds the same ids as its own (see ``collect``).
            incarnation = headers[H_INCARNATION]
            log_event(
                log, Event.FOREIGN_DEAD_LETTER_IGNORED, group_id=group_id, incarnation=incarnation, seq=msg.sequence
            )
            return 0
        origin = f"{headers.get(H_STREAM, '')}:{headers.get(H_SEQ, '')}"
        if H_REINJECTED in headers:
            letter = int(headers[H_REINJECTED])
            self.ledger.reinjected.add(origin)
            if self.ledger.reopen(group_id, time.monotonic()):
                log_event(log, Event.GROUP_REOPENED, group_id=group_id, dead_letter=letter)
                self.on_reopened(group_id, letter)
            else:  # applied, dropped or lost meanwhile, or never dead here: its copy will be refused as a repeat
                log_event(log, Event.REOPEN_REFUSED, level=logging.WARNING, group_id=group_id, dead_letter=letter)
            return 0
        if origin in self.ledger.reinjected:  # the re-injected message, dead-lettered again by a replay: not news
            log_event(log, Event.DEAD_LETTER_OF_REINJECTED_IGNORED, group_id=group_id, origin=origin, seq=msg.sequence)
            return 0
        if not self.ledger.settle([group_id], self.progress.step, Fate.DEAD):
            return 0
        log_event(log, Event.GROUP_LOST_TO_DEAD_LETTERS, level=logging.WARNING, group_id=group_id)
        return 1

    def _ours(self, headers: dict[str, str]) -> bool:
        """Whether a message is of this incarnation's groups (one from before incarnations were stamped counts)."""
        incarnation = headers.get(H_INCARNATION)
        return not incarnation or incarnation == self.progress.incarnation

    def _broker_failed(self, step: str, error: BaseException) -> None:
        self.broker.failed()
        log_event(
            log,
            Event.BROKER_CALL_FAILED,
            level=logging.WARNING,
            step=step,
            failures=self.broker.failures,
            retry_s=round(self.broker.retry_in(), 2),
            error=repr(error)[:300],
        )

    async def write_off_overdue(self, cfg: RunConfig) -> list[str]:
        """Groups in flight past the bound, overtaken by later ones, and not waiting unread in EXPERIENCE: their
        deliveries are spent. Looked at every ``LOST_CHECK_S``; skipped while EXPERIENCE holds a backlog (after
        a pause, say), in which an overdue group may still be waiting."""
        now = time.monotonic()
        if now - self.lost_checked < LOST_CHECK_S:
            return []
        self.lost_checked = now
        overdue = self.ledger.overdue(now, cfg.train.lost_after_s)
        if not overdue or self.broker.retry_in() > 0:
            return []
        try:
            waiting = await self._waiting_in_experience(cfg)
        except (NatsError, TimeoutError) as error:  # the broker, not the groups: look again after the backoff
            self._broker_failed("write_off", error)
            return []
        self.broker.succeeded()
        if waiting is None:
            return []
        lost = self.ledger.settle([g for g in overdue if g not in waiting], self.progress.step, Fate.LOST)
        if lost:
            await self.on_lost(lost)
        return lost

    async def _waiting_in_experience(self, cfg: RunConfig) -> set[str | None] | None:
        """The groups EXPERIENCE holds unread, or None when it holds more than the in-flight limit (a backlog)."""
        stream = stream_name(self.bus.run_id, EXPERIENCE)
        last = (await self.bus.js.stream_info(stream)).state.last_seq
        first_unread = self.reader.next_seq
        if last - first_unread + 1 > cfg.train.max_inflight_batches * cfg.train.batch_size:
            return None
        waiting = set()
        for seq in range(first_unread, last + 1):
            with contextlib.suppress(NotFoundError):
                waiting.add(((await self.bus.js.get_msg(stream, seq)).headers or {}).get(H_GROUP))
        return waiting

    async def _dead_letter(self, msg: StreamMessage, reason: str) -> bool:
        """Copy an EXPERIENCE message to DEAD; False when the broker failed it (or is still backed off from failing),
        after which the caller drops the partial batch, so the loop goes on beating and takes operator commands,
        and the message is read again (and its dead letter tried again) by the next ``collect``."""
        if (wait := self.broker.retry_in()) > 0:
            await asyncio.sleep(min(wait, 1.0))
            return False
        try:
            await self.bus.dead_letter(msg, reason, EXPERIENCE)
        except (NatsError, TimeoutError) as error:
            self._broker_failed("dead_letter", error)
            return False
        self.broker.succeeded()
        return True

    async def collect(
        self, cfg: RunConfig, config_version: int, interrupted: Callable[[], Awaitable[bool]], stop: asyncio.Event
    ) -> Collected | None:
        """The next ``batch_size`` usable groups in stream order; None when ``interrupted`` (an operator command,
        a config change, the claim store down) drops the partial batch, which is re-read from the last applied
        sequence."""
        batch: list[ExperienceGroup] = []
        dropped: list[str] = []
        filtered: list[str] = []
        claims: list[tuple[int, str]] = []
        in_batch: set[str] = set()
        sequence = self.progress.applied_seq
        if self.reader is None:
            self.rewind()
        while len(batch) < cfg.train.batch_size and not stop.is_set():
            if await interrupted():
                self.rewind()
                return None
            await self.catch_up_dead()
            await self.feed(cfg, config_version, accepted=len(batch))
            msg = await self.reader.next(timeout=1.0)
            await self.write_off_overdue(cfg)
            if msg is None:
                continue
            group_id = (msg.headers or {}).get(H_GROUP)
            with span_from_headers("trainer.experience", msg.headers, group_id=group_id, seq=msg.sequence):
                sequence = msg.sequence
                try:
                    group = await self.bus.decode(msg, ExperienceGroup)
                    if (problem := token_id_problem(group, self.vocab_size)) is not None:
                        raise DecodeError(f"invalid ExperienceGroup: {problem}")
                except DecodeError as error:
                    if not await self._dead_letter(msg, str(error)):
                        self.rewind()  # the broker's failure, not the message's: read it again next time
                        return None
                    # Its group is settled by reading the letter back from DEAD, in DEAD's order: a letter written
                    # again by a replay after a resume then cannot undo a re-inject recorded after the first one.
                    await self.catch_up_dead()
                    continue
                except StoreUnavailable as error:  # read it again once the store answers; the partial batch too
                    log_event(log, Event.CLAIM_UNAVAILABLE, level=logging.WARNING, seq=msg.sequence, error=str(error))
                    await asyncio.sleep(2.0)
                    self.rewind()
                    return None
                if (claim := self.bus.claim_key(msg)) is not None:
                    claims.append((msg.sequence, claim))
                if group.incarnation and group.incarnation != self.progress.incarnation:
                    # Fed by an incarnation that started over without a checkpoint: its steps are abandoned, and
                    # this incarnation feeds the same ids as its own groups, which must not be refused as repeats.
                    log_event(log, Event.FOREIGN_GROUP_DROPPED, group_id=group.group_id, incarnation=group.incarnation)
                    continue
                if self.ledger.fate(group.group_id) == Fate.DEAD:
                    await self.catch_up_dead()  # a re-injected copy may come before the record that reopens it
                if group.group_id in in_batch:
                    self.ledger.repeats += 1
                if group.group_id in in_batch or not self.ledger.arrived(group.group_id):
                    log_event(log, Event.REPEAT_DROPPED, group_id=group.group_id, seq=msg.sequence)
                    continue
                in_batch.add(group.group_id)
                # Synchronous, only the policy being trained may have generated a group (staleness 0).
                if self._unusable(group, 0 if cfg.train.synchronous else cfg.train.max_staleness):
                    dropped.append(group.group_id)
                    continue
                if cfg.train.dynamic_sampling and without_signal(group):
                    filtered.append(group.group_id)  # the loop reads on: the batch is filled from the stream
                    if len(filtered) == FILTERED_ALERT_BATCHES * cfg.train.batch_size:
                        log_event(
                            log,
                            Event.DYNAMIC_SAMPLING_FILTERING_MOST,
                            level=logging.WARNING,
                            alert=True,
                            filtered=len(filtered),
                            kept=len(batch),
                        )
                    continue
                batch.append(group)
        return Collected(batch, dropped, sequence, claims, filtered)

    def _unusable(self, group: ExperienceGroup, max_staleness: int | None) -> bool:
        stale = max_staleness is not None and self.progress.version - group.policy_version > max_staleness
        return stale or self.progress.disowned(group.policy_version)
