"""The trainer's intake: it feeds PROMPTS and reads EXPERIENCE in stream order, asking the ledger
(services/trainer/intake/ledger.py) what became of each group.

Slots are reconciled, not only counted: dead letters are read from the DEAD stream by
sequence (none is missed while the trainer reconnects or is down; the sequence read through is
kept in checkpoints, so a resumed trainer reads on after it), only this incarnation's letters
settle groups, and a re-inject record there (``rlpipe dead-letters --reinject``) reopens the
group it names, which is then in flight again until its copy comes back. A DEAD message is judged by
the subject it came on, never by its headers alone (``dead_letters.forged``): a stage's letter
counts only for the stream that stage reads, a re-inject record only from the operator's subject.
A group that has been in flight for ``train.lost_after_s``, that a group fed after it has
overtaken, that is not waiting unread in EXPERIENCE and of which no work queue holds a message a
stage may still settle (``work_queues.groups_queued``), is recorded as lost and its slot freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from nats.errors import Error as NatsError
from nats.js.errors import BadRequestError, NotFoundError

from services.common.config import TrainConfig
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.observe.telemetry import span_from_headers
from services.common.transport.breaker import CircuitBreaker
from services.common.transport.bus import Bus
from services.common.transport.claims import StoreUnavailable
from services.common.transport.dead_letters import forged
from services.common.transport.messages import DecodeError, Episode, ExperienceGroup, Prompt, dedupe_id
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
from services.trainer.intake.episode_stats import episodes_of
from services.trainer.intake.feeder import PromptFeeder
from services.trainer.intake.ledger import Fate, GroupLedger, cursor_position, feeding_order
from services.trainer.progress import Progress

log = logging.getLogger(__name__)
LOST_CHECK_S = 1.0  # how often groups in flight are checked against train.lost_after_s
# Dynamic sampling that has filtered this many batches' worth of groups while filling one batch alerts: the task is
# too easy or too hard for the policy (every group all right or all wrong), and the step may never come.
FILTERED_ALERT_BATCHES = 10


@dataclass
class Collected:
    """One step's worth of EXPERIENCE: the groups to train on, those dropped or filtered, and how far it read."""

    batch: list[ExperienceGroup]
    dropped: list[str]
    sequence: int  # the last EXPERIENCE sequence read for this batch
    claim_keys: list[tuple[int, str]] = field(default_factory=list)  # claim-checked bodies read, by sequence
    filtered: list[str] = field(default_factory=list)  # groups without signal, left out by dynamic sampling
    filtered_episodes: list[Episode] = field(default_factory=list)  # their episodes, for the agent metrics

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


def unusable(group: ExperienceGroup, progress: Progress, max_staleness: int | None) -> bool:
    """Whether ``group`` must be dropped on arrival, per token: it is as stale as its oldest sampled token (more than
    ``max_staleness`` versions behind the trainer's; None: no bound), and one token sampled by a version a resume or
    rollback disowned drops it. Without per-token versions every token is the group's ``policy_version``."""
    stale = max_staleness is not None and progress.version - group.oldest_version() > max_staleness
    return stale or any(progress.disowned(version) for version in group.versions_used())


class Intake:
    """Feeds prompts up to the in-flight limit and collects batches from EXPERIENCE."""

    def __init__(
        self,
        bus: Bus,
        feeder: PromptFeeder,
        ledger: GroupLedger,
        progress: Progress,
        on_lost: Callable[[list[str]], Awaitable[None]],
        on_reopened: Callable[[str, int], Awaitable[None]],
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
        self.refused: set[str] = set()  # prompts the broker refused for themselves, alerted once each

    def rewind(self) -> StreamReader:
        """Read EXPERIENCE again after the last applied sequence: after a restore, a rollback, or a dropped batch,
        whose groups are in flight again until they are read again (``GroupLedger.unread``). Returns the reader."""
        self.ledger.unread(time.monotonic())
        if self.reader is None:
            self.reader = self.bus.read_from(EXPERIENCE, self.progress.applied_seq + 1)
        else:  # the same reader, and so the same reply subscription
            self.reader.seek(self.progress.applied_seq + 1)
        return self.reader

    async def feed(self, train: TrainConfig, config_version: int, accepted: int = 0) -> None:
        """Top PROMPTS up to the in-flight bound. Synchronous (``train.synchronous``), the bound is one batch
        counting the ``accepted`` groups of the batch being collected, so nothing is fed for the next step until
        this one is trained (a group dropped as stale frees its slot for a fresh one), and each prompt asks for
        the version just published.

        The prompts go out together, their PubAcks awaited at once rather than a round trip each. Those that
        landed are in flight; at the first that failed the feeder seeks back, so it and any after it that failed
        are fed again later (one that did land is known and skipped then), and the ledger's watermark stays below
        the feeder's cursor (``GroupLedger.unfed_from``) until they are."""
        synchronous = train.synchronous
        limit = train.batch_size if synchronous else train.max_inflight_batches * train.batch_size
        batch: list[tuple[dict[str, int], Prompt]] = []
        while len(self.ledger.in_flight) + len(batch) + (accepted if synchronous else 0) < limit:
            cursor = self.feeder.cursor
            prompt = self.feeder.next()
            if self.ledger.known(prompt.group_id):
                continue  # settled before a restart (dead-lettered, say): feeding it again would apply it twice
            prompt.config_version = config_version
            prompt.incarnation = self.progress.incarnation
            prompt.min_policy_version = self.progress.version if synchronous else 0
            batch.append((cursor, prompt))
        publishes = (self.bus.publish(PROMPTS, prompt, msg_id=dedupe_id(prompt, "prompt")) for _, prompt in batch)
        results = await asyncio.gather(*publishes, return_exceptions=True)
        first_failed: dict[str, int] | None = None
        unexpected: BaseException | None = None
        for (cursor, prompt), result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                first_failed = first_failed or cursor
                if isinstance(result, BadRequestError):
                    self._refused(prompt.group_id, result)
                elif isinstance(result, NatsError | TimeoutError | StoreUnavailable):  # the broker or claim store
                    log_event(
                        log,
                        Event.FEED_FAILED,
                        level=logging.WARNING,
                        group_id=prompt.group_id,
                        error=repr(result)[:300],
                    )
                else:  # a bug rather than an outage: raised once the prompts that landed are recorded
                    unexpected = unexpected or result
                continue
            if result.duplicate:
                # Fed before a restart inside the duplicate window: it is somewhere downstream (or in DEAD, which
                # catch_up_dead settles), so it is in flight; the lost-group bound frees the slot if it never comes.
                log_event(log, Event.FEED_REPEATED, group_id=prompt.group_id)
            self.ledger.fed(prompt.group_id, time.monotonic())
        if first_failed is not None:
            self.feeder.seek(first_failed)  # publish them again later; a copy that did land is deduplicated
        self.ledger.unfed_from = cursor_position(self.feeder.cursor)
        if unexpected is not None:
            raise unexpected

    def _refused(self, group_id: str, error: BadRequestError) -> None:
        """The broker refused the prompt itself (400: over the stream's max_msg_size, which only a stream changed by
        hand has below ``nats.max_message_bytes``). Fed again each step, as an outage's would be, so nothing is
        lost once the cause is fixed; meanwhile the ledger's watermark waits below it, so the operator is alerted."""
        first = group_id not in self.refused
        self.refused.add(group_id)
        log_event(
            log,
            Event.FEED_REFUSED,
            level=logging.ERROR if first else logging.DEBUG,
            **({"alert": True} if first else {}),
            group_id=group_id,
            error=f"{error.description} (err_code {error.err_code})",
        )

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
            new += await self._read_dead(msg)
        return new

    async def _read_dead(self, msg: StreamMessage) -> int:
        """Act on one DEAD message: 1 when it settled a group as dead, else 0."""
        headers = msg.headers or {}
        if (why := forged(self.bus.run_id, msg.subject, headers)) is not None:
            log_event(
                log, Event.DEAD_LETTER_FORGED, level=logging.ERROR, alert=True, seq=msg.sequence, reason=why[:300]
            )
            return 0
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
                await self.on_reopened(group_id, letter)
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

    async def write_off_overdue(self, train: TrainConfig) -> list[str]:
        """Groups in flight past the bound, overtaken by later ones, not waiting unread in EXPERIENCE and with no
        message a stage may still deliver (services/common/transport/work_queues.py: a long compute is not a
        loss): their deliveries are spent. Looked at every ``LOST_CHECK_S``; skipped while EXPERIENCE or the work
        queues hold a backlog (after a pause, say), in which an overdue group may still be waiting."""
        now = time.monotonic()
        if now - self.lost_checked < LOST_CHECK_S:
            return []
        self.lost_checked = now
        overdue = self.ledger.overdue(now, train.lost_after_s)
        if not overdue or self.broker.retry_in() > 0:
            return []
        try:
            waiting = await self._waiting_in_experience(train)
        except (NatsError, TimeoutError) as error:  # the broker, not the groups: look again after the backoff
            self._broker_failed("write_off", error)
            return []
        self.broker.succeeded()
        if waiting is None:
            return []
        try:
            queued = await self.bus.groups_queued(self.progress.incarnation)
        except (NatsError, TimeoutError) as error:
            self._broker_failed("write_off", error)
            return []
        if queued is None:
            return []
        gone = [g for g in overdue if g not in waiting and g not in queued]
        lost = self.ledger.settle(gone, self.progress.step, Fate.LOST)
        if lost:
            await self.on_lost(lost)
        return lost

    async def _waiting_in_experience(self, train: TrainConfig) -> set[str | None] | None:
        """The groups EXPERIENCE holds unread, or None when it holds more than the in-flight limit (a backlog)."""
        stream = stream_name(self.bus.run_id, EXPERIENCE)
        last = (await self.bus.js.stream_info(stream)).state.last_seq
        # Nothing read yet: the reader would start after the last applied sequence (``rewind``).
        first_unread = self.reader.next_seq if self.reader is not None else self.progress.applied_seq + 1
        if last - first_unread + 1 > train.max_inflight_batches * train.batch_size:
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
        self, train: TrainConfig, config_version: int, interrupted: Callable[[], Awaitable[bool]], stop: asyncio.Event
    ) -> Collected | None:
        """The next ``batch_size`` usable groups in stream order; None when ``interrupted`` (an operator command,
        a config change, the claim store down) drops the partial batch, which is re-read from the last applied
        sequence."""
        batch: list[ExperienceGroup] = []
        dropped: list[str] = []
        filtered: list[str] = []
        filtered_episodes: list[Episode] = []
        claims: list[tuple[int, str]] = []
        in_batch: set[str] = set()
        sequence = self.progress.applied_seq
        reader = self.reader if self.reader is not None else self.rewind()
        while len(batch) < train.batch_size and not stop.is_set():
            if await interrupted():
                self.rewind()
                return None
            if not reader.buffered:
                # DEAD is looked at before each read that goes to the broker, not before every message read ahead:
                # a letter settles a group whichever comes first, and one a read group needs is read at once below.
                await self.catch_up_dead()
            await self.feed(train, config_version, accepted=len(batch))
            msg = await reader.next(timeout=1.0)
            await self.write_off_overdue(train)
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
                if self._unusable(group, 0 if train.synchronous else train.max_staleness):
                    dropped.append(group.group_id)
                    continue
                if train.dynamic_sampling and without_signal(group):
                    filtered.append(group.group_id)  # the loop reads on: the batch is filled from the stream
                    filtered_episodes.extend(episodes_of([group]))
                    if len(filtered) == FILTERED_ALERT_BATCHES * train.batch_size:
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
        if train.deterministic:
            # Arrival order is the pipeline's timing; feeding order is the run's own (the groups' sums, the batch's
            # rows and its mini-batches follow it).
            batch.sort(key=lambda group: feeding_order(group.group_id))
        return Collected(batch, dropped, sequence, claims, filtered, filtered_episodes)

    def _unusable(self, group: ExperienceGroup, max_staleness: int | None) -> bool:
        return unusable(group, self.progress, max_staleness)
