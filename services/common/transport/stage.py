"""The loop every stateless role runs: fetch a batch from its work queue, decode, compute, publish, settle.

A stage step is always: fetch -> decode -> compute -> publish downstream with
``Nats-Msg-Id = <group id>.<stage>`` and wait for the ack -> ack upstream. A batch's outputs are published
together and its inputs acked together once every output is in: two round trips a batch, not two a message.
A crash anywhere repeats at most the compute, and the duplicate window drops the
repeated publish. How each message is settled (ack, nak with a delay, dead letter) is decided by
``services.common.transport.settle``; this module carries the decision out.

Every published message carries the sender's trace context in its headers, and a
stage handles each message inside a span that continues it (see
``services.common.observe.telemetry``), so one group's work across services is one trace.

Bad message or dependency down. A message that is itself bad (undecodable, failing
validation, a compute that raises anything but ``DependencyUnavailable``) spends its
deliveries and goes to DEAD with the reason. A dependency outage consumes no delivery:
when reading or storing a claim-checked body fails (``StoreUnavailable``), the compute
raises ``DependencyUnavailable`` (a dead engine), or the downstream publish fails, the
stage keeps the messages it holds, tells JetStream they are in progress, and retries
the failed step with exponential backoff behind a ``CircuitBreaker`` (``OutageGate``,
services/common/transport/outage.py, which also alerts on a long outage). While the stage
holds them it fetches nothing, so the rest wait in the stream, undelivered.
Only a stop during an outage gives the held messages back (nak), which, like a crash,
costs each one delivery.

Hung work. One compute may take at most ``nats.max_work_s``; past it the stage abandons it
(cancels the await: a thread it runs in cannot be killed and finishes unheeded) and naks
the batch's messages with backoff, each spending a delivery, without splitting the batch
(that would multiply the wait by its size). On its last delivery a message goes to DEAD
with reason ``timeout``. ``Stage.last_progress`` is the wall time the loop last moved (a
fetch returned, a message settled, a dependency retried): a loop stuck past
``stall_bound_s`` is reported NOT_SERVING by the service's health (services/common/service.py)
and as stalled in its presence entry.

Lanes. ``Stage.lanes`` loops run at once, each fetching, computing and settling a batch of its own on the same
consumer (the rollout's multi-turn path: one batch's episodes wait on their environments while the next batch's
use the engine). They share the breaker, the metrics and the time share; a crash of one loop ends the others.

Where the time goes. ``Stage.time_share`` counts the loop's wall time as idle (fetching: waiting for input),
busy (decoding, computing, settling) or blocked (publishing downstream, waiting out a dependency's outage, or,
in the rollout, pulling new weights); the three sum to the time since the loop started. They are exported as
``rlpipe_stage_time_seconds{activity}`` and written into the replica's presence entry, from which the trainer
puts each role's fractions into its metrics rows (``share/<role>/<activity>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import MsgAlreadyAckdError, NotJSMessageError
from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from services.common.cancel import cancel_until_done
from services.common.config import NatsConfig
from services.common.observe.events import Event
from services.common.observe.instruments import StageMetrics
from services.common.observe.logs import log_event
from services.common.observe.telemetry import start_span_from_headers
from services.common.observe.timeshare import STAGE_PRECEDENCE, StageActivity, TimeShare, in_lane
from services.common.transport.breaker import DependencyUnavailable
from services.common.transport.bus import Bus
from services.common.transport.claim_lifecycle import deletable_after_ack, missing_body_is_stale
from services.common.transport.claims import ClaimMissing
from services.common.transport.messages import DecodeError, Prompt, dedupe_id
from services.common.transport.outage import OutageGate, StoppedDuringOutage
from services.common.transport.settle import Ack, DeadLetter, Decision, Nak, Outcome, settle, unsettled_letter
from services.common.transport.streams import H_GROUP

log = logging.getLogger(__name__)

# A stage's messages are a group's, from the prompt on: each names its group (its id, and its dedupe id).
In = TypeVar("In", bound=Prompt)
Out = TypeVar("Out", bound=Prompt)
T = TypeVar("T")


def stall_bound_s(nats_cfg: NatsConfig) -> float:
    """Seconds without progress after which a stage's loop counts as stuck: a compute is abandoned after
    ``max_work_s``, so twice that (plus a fetch) means even abandoning it did not free the loop."""
    return 2 * nats_cfg.max_work_s + nats_cfg.fetch_timeout_s


class WorkTimedOut(Exception):
    """A compute ran past ``nats.max_work_s`` and was abandoned."""


class Unsettled(Exception):
    """A message that used up its deliveries without any of them reaching an outcome."""


@contextlib.asynccontextmanager
async def heartbeat(held: Callable[[], list[Received]], interval_s: float) -> AsyncIterator[None]:
    """Tell JetStream that ``held()`` (asked anew at each beat) are still being worked on: no redelivery. Each beat
    that lands is ``touch``ed: how long a message went without one says whether it may have a twin."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(interval_s)
            for one in held():
                with contextlib.suppress(Exception):  # a broker away: the beat after it comes back counts
                    await one.msg.in_progress()
                    one.touch()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        await cancel_until_done(task)


def _unsettled(received: list[Received]) -> list[Received]:
    return [one for one in received if not one.settled]


@dataclass
class Received(Generic[In]):
    """One fetched message on its way through a stage, with the span that follows it to settlement."""

    msg: Msg
    span: Span
    fetched_at: float  # time.perf_counter() at fetch
    item: In | None = None
    published: bool = False  # its output is in the downstream stream
    settled: bool = False
    last_touch: float = 0.0  # time.perf_counter() of the fetch or the last beat that landed
    longest_gap_s: float = 0.0  # the longest the broker went without hearing of this delivery so far

    def __post_init__(self) -> None:
        self.last_touch = self.fetched_at

    @property
    def decoded(self) -> In:
        """The decoded message, which every message past decoding has."""
        if self.item is None:
            raise RuntimeError("a stage used a message it had not decoded")
        return self.item

    def touch(self) -> None:
        now = time.perf_counter()
        self.longest_gap_s = max(self.longest_gap_s, now - self.last_touch)
        self.last_touch = now

    def gap_until_now(self) -> float:
        """``longest_gap_s`` counting the time since the last touch."""
        return max(self.longest_gap_s, time.perf_counter() - self.last_touch)


@dataclass
class Stage(Generic[In, Out]):
    """A stateless pipeline stage: pulls ``consumes``, computes, publishes ``produces``.

    ``compute`` maps a batch of decoded inputs to one output each. If a batch
    fails, its items are retried one by one so a single bad input cannot sink
    the others; an item that keeps failing goes to DEAD after MaxDeliver tries.

    Each message gets its own span ``<role>.<edge>``, continuing the trace in its
    headers, from fetch until it is acked, nakked or terminated; it is the current
    span only around that message's own publish, so a batch computed together still
    sends each group on in its own trace.
    """

    bus: Bus
    consumes: str
    produces: str
    input_kind: type[In]
    compute: Callable[[list[In]], Awaitable[list[Out]]]
    batch: int
    name: str
    # Batches in hand at once, each fetched, computed and settled by a loop of its own on one consumer: the
    # rollout's episodes of one batch may wait on their environments while the next batch's use the engine.
    lanes: int = 1
    handled: int = 0
    metrics: StageMetrics = field(init=False)
    # Over every dependency of the stage (claim store, compute, broker): services/common/transport/outage.py
    outage: OutageGate = field(init=False)
    last_progress: float = field(init=False, default_factory=time.time)  # wall time; see the module docstring
    time_share: TimeShare[StageActivity] = field(init=False)  # see "Where the time goes" in the module docstring

    def stalled_for(self, now: float) -> float:
        """Seconds the loop has gone without progress beyond ``stall_bound_s`` (0 while it is moving)."""
        return max(0.0, now - self.last_progress - stall_bound_s(self.bus.cfg.nats))

    def __post_init__(self) -> None:
        self.metrics = StageMetrics(self.bus.service, self.consumes)
        self.metrics.lag(0)  # until the first fetch says otherwise
        self.metrics.watch_progress(self.stalled_for)
        self.time_share = TimeShare(StageActivity.IDLE, precedence=STAGE_PRECEDENCE)
        self.metrics.watch_time(self.time_share.seconds)
        nats_cfg = self.bus.cfg.nats
        self.outage = OutageGate(self.metrics, self.time_share, nats_cfg.ack_wait_s * nats_cfg.max_deliver, self._moved)

    def _moved(self) -> None:
        self.last_progress = time.time()

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch, compute and settle batches until ``stop``: ``lanes`` loops at once, each with its own
        subscription to the stage's consumer (JetStream hands each fetch different messages)."""
        if self.lanes == 1:
            await self._loop(stop)
            return
        loops = [asyncio.create_task(self._loop(stop, lane)) for lane in range(self.lanes)]
        try:
            await asyncio.wait(loops, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # one loop's crash (or the caller's cancellation) ends the others: their batches are redelivered
            await cancel_until_done(*loops)
        for loop in loops:
            if not loop.cancelled() and (error := loop.exception()) is not None:
                raise error

    async def _loop(self, stop: asyncio.Event, lane: int = 0) -> None:
        in_lane(lane)  # each loop runs in a task of its own: the lane is that task's
        nats_cfg = self.bus.cfg.nats
        queue = None
        while not stop.is_set():
            self.time_share.enter(StageActivity.IDLE)
            try:
                # (Re)created after a broker outage: nats-py does not always revive a pull subscription.
                queue = queue or await self.bus.work_queue(self.consumes)
                msgs = await queue.fetch(self.batch, timeout=nats_cfg.fetch_timeout_s)
            except TimeoutError:  # nats' own TimeoutError subclasses it; fetch raises either
                self.last_progress = time.time()
                continue
            except NatsError as error:
                log_event(log, Event.BUS_UNAVAILABLE, level=logging.WARNING, error=repr(error)[:300])
                queue = None
                with self.time_share.during(StageActivity.BLOCKED):
                    await asyncio.sleep(1.0)
                continue
            self.last_progress = time.time()
            if not msgs:  # fetch can also come back empty-handed
                continue
            if stop.is_set():
                await self._hand_back(msgs)
                continue
            self.time_share.enter(StageActivity.BUSY)
            # The newest message says how many still wait behind it. A fetch that finds nothing leaves the
            # value as it was: either the queue drained (its last message said 0) or the consumer is at
            # max_ack_pending, when the old value is the better guess.
            self.metrics.lag(msgs[-1].metadata.num_pending)
            fetched_at = time.perf_counter()
            received = [self._receive(msg, fetched_at) for msg in msgs]
            try:
                # Held messages stay ours while a dependency is down, however long that takes.
                async with heartbeat(functools.partial(_unsettled, received), nats_cfg.heartbeat_s):
                    await self._handle(received, stop)
            except StoppedDuringOutage:
                # Stopped during an outage: hand the held messages back now rather than after AckWait.
                for one in received:
                    if not one.settled:
                        with contextlib.suppress(NatsError, TimeoutError):
                            await one.msg.nak()
                        self._settle(one, Nak.label)
            finally:
                # Only reached unsettled by an exception (a broker error, cancellation): unacked, it is redelivered.
                for one in received:
                    if not one.settled:
                        self._settle(one, Nak.label)

    async def _hand_back(self, msgs: list[Msg]) -> None:
        """Messages a fetch took after the stop was asked for (a scale-in, a rolling update): back to the queue at
        once for another replica, not computed here, where the stop grace may not cover a whole batch and a kill
        would leave them to ``ack_wait_s``."""
        for msg in msgs:
            with contextlib.suppress(NatsError, TimeoutError):
                await msg.nak()
        log_event(log, Event.HANDED_BACK_AT_STOP, messages=len(msgs))

    async def _handle(self, received: list[Received[In]], stop: asyncio.Event) -> None:
        nats_cfg = self.bus.cfg.nats
        decoded: list[Received[In]] = []
        for one in received:
            letter = unsettled_letter(one.msg.metadata.num_delivered, nats_cfg.max_deliver, self.bus.service)
            if letter is not None:
                await self._carry_out(one, letter, Unsettled(letter.reason), stop)
                continue
            try:
                # A claim store that is down holds the message here (StoreUnavailable), spending no delivery.
                one.item = await self.outage.available(
                    functools.partial(self.bus.decode, one.msg, self.input_kind), "claim_read", stop
                )
            except ClaimMissing as error:
                if missing_body_is_stale(one.gap_until_now(), nats_cfg.ack_wait_s):
                    # A twin delivery may have consumed it and deleted the body (claim_lifecycle): not this
                    # message's fault to judge here. If it is still queued, the next delivery decides.
                    log_event(log, Event.CLAIM_MISSING_AFTER_LAPSE, level=logging.WARNING, error=str(error)[:300])
                    await self._on_broker(functools.partial(one.msg.nak, delay=0), "nak", stop)
                    self._settle(one, Nak.label, error)
                    continue
                await self._carry_out(one, self._decide(one, Outcome.UNDECODABLE, error), error, stop)
                continue
            except DecodeError as error:
                await self._carry_out(one, self._decide(one, Outcome.UNDECODABLE, error), error, stop)
                continue
            one.span.set_attribute("rlpipe.group_id", one.item.group_id)
            decoded.append(one)
        if decoded:
            await self._process(decoded, stop)

    async def _on_broker(self, call: Callable[[], Awaitable[T]], step: str, stop: asyncio.Event) -> T:
        """``call()`` (a dead-letter publish, a term, a nak), retried behind the breaker while the broker fails it:
        a blip while settling a message is an outage like any other, not a reason to crash the stage."""

        async def attempt() -> T:
            try:
                return await call()
            except (MsgAlreadyAckdError, NotJSMessageError):  # our bug, not the broker's: retrying cannot help
                raise
            except (NatsError, TimeoutError) as error:
                raise DependencyUnavailable(f"{step} failed: {error!r}") from error

        return await self.outage.available(attempt, step, stop)

    async def _publish_all(self, decoded: list[Received[In]], outputs: list[Out]) -> None:
        """Publish each output not yet in the stream, all at once (one flush, the PubAcks awaited together rather
        than a round trip each), each inside its input's span. An output whose publish failed is tried again by
        the next attempt; those that landed are not sent twice (and would be deduplicated if they were)."""

        async def publish(one: Received[In], output: Out) -> None:
            with trace.use_span(one.span, end_on_exit=False):
                await self.bus.publish(self.produces, output, msg_id=dedupe_id(output, self.name))
            one.published = True

        pending = [(one, output) for one, output in zip(decoded, outputs, strict=True) if not one.published]
        with self.time_share.during(StageActivity.BLOCKED):
            results = await asyncio.gather(*(publish(one, output) for one, output in pending), return_exceptions=True)
        for error in results:
            if isinstance(error, NatsError | TimeoutError):
                # The broker, not the message: retried with the outputs in hand, so the compute is not repeated.
                raise DependencyUnavailable(f"publish to {self.produces} failed: {error!r}") from error
            if isinstance(error, BaseException):
                raise error

    def _receive(self, msg: Msg, fetched_at: float) -> Received[In]:
        headers = msg.headers or {}
        span = start_span_from_headers(
            f"{self.bus.service}.{self.consumes}",
            headers,
            group_id=headers.get(H_GROUP),
            delivery=msg.metadata.num_delivered,
        )
        return Received(msg, span, fetched_at)

    def _settle(self, one: Received[In], outcome: str, error: BaseException | None = None) -> None:
        one.settled = True
        self.last_progress = time.time()
        self.metrics.settled(outcome, time.perf_counter() - one.fetched_at)
        one.span.set_attribute("rlpipe.outcome", outcome)
        if error is not None:
            one.span.record_exception(error)
            if outcome == "dead":
                one.span.set_status(StatusCode.ERROR, repr(error)[:300])
        one.span.end()

    async def _process(self, decoded: list[Received[In]], stop: asyncio.Event) -> None:
        try:
            outputs = await self.outage.available(
                functools.partial(self._capped_compute, [one.decoded for one in decoded]), "compute", stop
            )
        except StoppedDuringOutage:
            raise
        except WorkTimedOut as error:  # abandoned whole: splitting would wait max_work_s per message
            log_event(log, Event.WORK_TIMED_OUT, level=logging.WARNING, error=str(error), size=len(decoded))
            for one in decoded:
                await self._carry_out(one, self._decide(one, Outcome.TIMED_OUT, error), error, stop)
            return
        except Exception as error:  # the inputs' fault: find the bad one(s)
            if len(decoded) == 1:
                await self._carry_out(decoded[0], self._decide(decoded[0], Outcome.FAILED, error), error, stop)
                return
            log_event(log, Event.BATCH_FAILED, level=logging.WARNING, error=repr(error), size=len(decoded))
            for one in decoded:
                await self._process([one], stop)
            return
        for one in decoded:
            one.span.add_event("computed", {"rlpipe.batch_size": len(decoded)})
        await self.outage.available(functools.partial(self._publish_all, decoded, outputs), "publish", stop)
        # Every output is in the stream: the inputs are acked together, one round trip for the batch.
        acks = (self._carry_out(one, self._decide(one, Outcome.COMPUTED), None, stop) for one in decoded)
        await asyncio.gather(*acks)

    async def _capped_compute(self, items: list[In]) -> list[Out]:
        """``compute(items)``, abandoned after ``nats.max_work_s`` with ``WorkTimedOut``."""
        limit = self.bus.cfg.nats.max_work_s
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                return await self.compute(items)
        except TimeoutError:
            if not deadline.expired():  # the compute's own TimeoutError (a slow dependency): not ours to relabel
                raise
            message = f"compute of {len(items)} message(s) took longer than nats.max_work_s={limit:g}s"
            raise WorkTimedOut(message) from None

    def _decide(self, one: Received[In], outcome: Outcome, error: BaseException | None = None) -> Decision:
        return settle(outcome, one.msg.metadata.num_delivered, self.bus.cfg.nats.max_deliver, error)

    async def _carry_out(
        self, one: Received[In], decision: Decision, error: BaseException | None, stop: asyncio.Event
    ) -> None:
        """Settle ``one`` as ``decision`` says. The broker calls a nak or a dead letter needs are retried behind the
        breaker like any outage; an ack that fails leaves the input to be redelivered after AckWait."""
        msg = one.msg
        with trace.use_span(one.span, end_on_exit=False):
            match decision:
                case Ack():
                    try:
                        await msg.ack_sync()
                    except (NatsError, TimeoutError) as ack_error:
                        # Unacked, the input is redelivered after AckWait; its repeat publish is deduplicated.
                        group_id = one.decoded.group_id  # an acked message was decoded
                        log_event(
                            log, Event.ACK_FAILED, level=logging.WARNING, group_id=group_id, error=repr(ack_error)[:300]
                        )
                        self._settle(one, Nak.label, ack_error)
                        return
                    self.handled += 1
                    one.touch()
                    await self._drop_consumed_body(one)
                case Nak(delay_s=delay_s):
                    delivered = msg.metadata.num_delivered
                    log_event(log, Event.COMPUTE_FAILED, level=logging.WARNING, error=repr(error), delivered=delivered)
                    await self._on_broker(functools.partial(msg.nak, delay=delay_s), "nak", stop)
                case DeadLetter(cause=cause, reason=reason):
                    letter = functools.partial(self.bus.dead_letter, msg, reason, self.consumes, cause.value)
                    await self._on_broker(letter, "dead_letter", stop)
                    await self._on_broker(msg.term, "term", stop)
        self._settle(one, decision.label, error)

    async def _drop_consumed_body(self, one: Received[In]) -> None:
        """Delete the claim-checked body of an input this delivery acked, when nobody can read it again
        (``claim_lifecycle.deletable_after_ack``: no twin delivery, no dead letter, no re-inject's letter holds it).
        A failure leaves it to the bucket's lifecycle rule: the message is done either way."""
        key = self.bus.claim_key(one.msg)
        if key is None:
            return
        if not deletable_after_ack(one.msg.headers, one.longest_gap_s, self.bus.cfg.nats.ack_wait_s):
            log_event(log, Event.CLAIM_KEPT, key=key, longest_gap_s=round(one.longest_gap_s, 3))
            return
        try:
            await asyncio.to_thread(self.bus.claims.delete, [key])
        except Exception as error:  # the store's many failure types; the lifecycle rule is the backstop
            log_event(log, Event.CLAIM_DELETE_FAILED, level=logging.WARNING, key=key, error=repr(error)[:300])
