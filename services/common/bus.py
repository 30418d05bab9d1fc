"""The JetStream bus: one stream per edge, namespaced by run id.

PROMPTS, ROLLOUTS and SCORED are work queues, each read by one durable pull
consumer that all replicas of the consuming role share. EXPERIENCE keeps its
messages (limits retention) so the trainer can re-read from a sequence after a
crash. DEAD collects what a stage could not handle, with the reason in headers.

A stage step is always: fetch -> decode -> compute -> publish downstream with
``Nats-Msg-Id = <group id>.<stage>`` and wait for the ack -> ack upstream.
A crash anywhere repeats at most the compute, and the duplicate window drops the
repeated publish.

Every published message carries the sender's trace context in its headers, and a
stage handles each message inside a span that continues it (see
``services.common.telemetry``), so one group's work across services is one trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import BadRequestError, NotFoundError
from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from services.common.config import RunConfig
from services.common.logs import log_event
from services.common.messages import ClaimCheck, DecodeError, Message, decode, encode
from services.common.storage import ObjectStore, open_store
from services.common.telemetry import StageMetrics, inject_trace, record_dead_letter, start_span_from_headers

PROMPTS, ROLLOUTS, SCORED, EXPERIENCE, DEAD = "prompts", "rollouts", "scored", "experience", "dead"
WORK_QUEUES = {PROMPTS: "rollout", ROLLOUTS: "reward", SCORED: "reference"}  # edge -> consuming role
EDGES = (PROMPTS, ROLLOUTS, SCORED, EXPERIENCE, DEAD)

# Dead-letter headers, also set on every published group so a dead letter can be traced back.
H_REASON, H_STREAM, H_SEQ, H_SERVICE, H_GROUP = (
    "Rlpipe-Reason",
    "Rlpipe-Source-Stream",
    "Rlpipe-Source-Seq",
    "Rlpipe-Service",
    "Rlpipe-Group-Id",
)
H_CLAIM = "Rlpipe-Claim-Check"  # the body is a ClaimCheck pointing into the object store

log = logging.getLogger(__name__)

In = TypeVar("In", bound=Message)
Out = TypeVar("Out", bound=Message)


def subject(run_id: str, edge: str) -> str:
    return f"rlpipe.{run_id}.{edge}"


def stream_name(run_id: str, edge: str) -> str:
    return f"RLPIPE_{run_id}_{edge.upper()}"


class Bus:
    """A connection to NATS with the run's streams in place."""

    def __init__(self, cfg: RunConfig, service: str):
        self.cfg = cfg
        self.service = service
        self.run_id = cfg.run_id
        self.nc: nats.NATS | None = None
        self.js: nats.js.JetStreamContext | None = None

    async def connect(self) -> Bus:
        self.nc = await nats.connect(
            self.cfg.nats.url,
            name=f"{self.run_id}-{self.service}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
        )
        self.js = self.nc.jetstream()
        await self.ensure_streams()
        return self

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            # Not drain(): unacked work simply redelivers, and a pending pull would stall the drain.
            await self.nc.close()

    def stream_config(self, edge: str) -> api.StreamConfig:
        nats_cfg = self.cfg.nats
        return api.StreamConfig(
            name=stream_name(self.run_id, edge),
            subjects=[subject(self.run_id, edge)],
            retention=api.RetentionPolicy.WORK_QUEUE if edge in WORK_QUEUES else api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE if nats_cfg.storage == "file" else api.StorageType.MEMORY,
            duplicate_window=nats_cfg.duplicate_window_s,
            num_replicas=nats_cfg.stream_replicas,
        )

    async def ensure_streams(self) -> None:
        for edge in EDGES:
            config = self.stream_config(edge)
            try:
                await self.js.add_stream(config)
            except BadRequestError:
                # Exists with other settings (e.g. a changed duplicate window): bring it up to date.
                await self.js.update_stream(config)

    async def decode(self, msg: Msg | StreamMessage, kind: type[In]) -> In:
        """Validate a received message as ``kind`` (fetching a claim-checked body); DecodeError says why it is unusable."""
        limit = self.cfg.nats.max_message_bytes
        if len(msg.data) > limit:
            raise DecodeError(f"message of {len(msg.data)} bytes exceeds nats.max_message_bytes={limit}")
        if msg.headers and msg.headers.get(H_CLAIM):
            claim = decode(msg.data, ClaimCheck)
            try:
                # Off the event loop: a slow store must not stall acks, heartbeats and admin calls.
                data = await asyncio.to_thread(lambda: self.claims.get(claim.key))
            except FileNotFoundError as error:
                raise DecodeError(f"claim-checked body {claim.key} is missing: {error}") from None
            except Exception as error:  # the store's many failure types: unreachable, refused, timed out
                raise StoreUnavailable(f"claim-checked body {claim.key} could not be read: {error!r}"[:500]) from error
            if len(data) != claim.size or hashlib.sha256(data).hexdigest() != claim.sha256:
                raise DecodeError(f"claim-checked body {claim.key} does not match its size and hash")
            return decode(data, kind)
        return decode(msg.data, kind)

    @staticmethod
    def claim_key(msg: Msg | StreamMessage) -> str | None:
        """The object-store key of a claim-checked message's body, None for an ordinary message."""
        if not (msg.headers and msg.headers.get(H_CLAIM)):
            return None
        try:
            return decode(msg.data, ClaimCheck).key
        except DecodeError:
            return None

    async def publish(self, edge: str, message: Message, msg_id: str) -> api.PubAck:
        """Publish and wait for the stream's ack; a repeat of ``msg_id`` inside the window is dropped.

        A body above ``nats.claim_check_bytes`` is stored in the object store first and the
        message carries its key (claim check), keeping payloads well under the server's limit.
        """
        headers = inject_trace({"Nats-Msg-Id": msg_id, H_SERVICE: self.service})
        group_id = getattr(message, "group_id", None)
        if group_id:
            headers[H_GROUP] = group_id
        data = encode(message)
        if len(data) > self.cfg.nats.claim_check_bytes:
            sha256 = hashlib.sha256(data).hexdigest()
            # Keyed by content too: a redelivered compute's body (a new sample) must not overwrite the body of
            # the message the stream kept, whose repeat the duplicate window drops.
            key = f"{self.run_id}/claims/{edge}/{msg_id}-{sha256[:16]}"
            await asyncio.to_thread(self.claims.put, key, data)
            data = encode(ClaimCheck(key=key, size=len(data), sha256=sha256))
            headers[H_CLAIM] = "1"
        return await self.js.publish(subject(self.run_id, edge), data, headers=headers, timeout=10)

    @functools.cached_property
    def claims(self) -> ObjectStore:
        return open_store(self.cfg.checkpoint_url, self.cfg.checkpoint)

    async def dead_letter(self, msg: Msg | StreamMessage, reason: str, edge: str, cause: str = "undecodable") -> None:
        """Copy ``msg`` to DEAD with why and where from; the caller terminates it upstream.

        ``cause`` is the reason's class for metrics (``undecodable`` or ``max_deliver``):
        the free-text reason would give every message its own time series.
        """
        sequence = msg.sequence if isinstance(msg, StreamMessage) else msg.metadata.sequence.stream
        headers = inject_trace(
            {
                H_REASON: reason[:1000].replace("\r", " ").replace("\n", " "),
                H_STREAM: stream_name(self.run_id, edge),
                H_SEQ: str(sequence),
                H_SERVICE: self.service,
                "Nats-Msg-Id": f"{edge}.{sequence}.dead",
            }
        )
        for carried in (H_GROUP, H_CLAIM):
            if msg.headers and carried in msg.headers:
                headers[carried] = msg.headers[carried]
        await self.js.publish(subject(self.run_id, DEAD), msg.data, headers=headers, timeout=10)
        record_dead_letter(self.service, edge, cause)
        log_event(log, "dead_letter", level=logging.WARNING, edge=edge, seq=sequence, reason=reason[:300])

    async def work_queue(self, edge: str) -> nats.js.JetStreamContext.PullSubscription:
        """The durable pull consumer of ``edge``, shared by every replica of its consuming role."""
        nats_cfg = self.cfg.nats
        durable = WORK_QUEUES[edge]
        return await self.js.pull_subscribe(
            subject(self.run_id, edge),
            durable=durable,
            stream=stream_name(self.run_id, edge),
            config=api.ConsumerConfig(
                durable_name=durable,
                ack_policy=api.AckPolicy.EXPLICIT,
                ack_wait=nats_cfg.ack_wait_s,
                # One delivery more than a compute may fail: a message whose earlier deliveries never came
                # back (the service crashed or hung on it) is dead-lettered on it instead of dropped silently.
                max_deliver=nats_cfg.max_deliver + 1,
                max_ack_pending=nats_cfg.max_ack_pending,
            ),
        )

    def read_from(self, edge: str, start_seq: int) -> StreamReader:
        """A reader of ``edge`` in stream order from sequence ``start_seq`` on."""
        return StreamReader(self, edge, start_seq)


@dataclass
class StreamMessage:
    sequence: int
    data: bytes
    headers: dict[str, str] | None


class StreamReader:
    """Reads a limits-retention stream message by message by sequence number.

    Stateless on the server (direct gets, no consumer), so a broker restart or a lost
    connection costs nothing but a retry, and a restarted trainer simply starts again
    from its checkpoint's sequence.
    """

    def __init__(self, bus: Bus, edge: str, start_seq: int):
        self.bus = bus
        self.stream = stream_name(bus.run_id, edge)
        self.subject = subject(bus.run_id, edge)
        self.next_seq = start_seq

    async def next(self, timeout: float) -> StreamMessage | None:
        """The next message, or None if none arrives within ``timeout`` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                raw = await self.bus.js.get_msg(self.stream, seq=self.next_seq, subject=self.subject, next=True)
            except NotFoundError:
                raw = None
            except (NatsError, TimeoutError) as error:
                log_event(log, "bus_unavailable", level=logging.WARNING, error=repr(error)[:300])
                raw = None
            if raw is not None:
                self.next_seq = raw.seq + 1
                return StreamMessage(raw.seq, raw.data or b"", dict(raw.headers) if raw.headers else None)
            if asyncio.get_running_loop().time() >= deadline:
                return None
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def heartbeat(msgs: Sequence[Msg], interval_s: float) -> AsyncIterator[None]:
    """Tell JetStream that ``msgs`` are still being worked on, so long computes are not redelivered."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(interval_s)
            for msg in msgs:
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class StoreUnavailable(Exception):
    """The object store holding a claim-checked body did not answer: the message is fine, try it again later."""


class Unsettled(Exception):
    """A message that used up its deliveries without any of them reaching an outcome."""


@dataclass
class Received(Generic[In]):
    """One fetched message on its way through a stage, with the span that follows it to settlement."""

    msg: Msg
    span: Span
    fetched_at: float  # time.perf_counter() at fetch
    item: In | None = None
    settled: bool = False


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
    handled: int = 0
    metrics: StageMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = StageMetrics(self.bus.service, self.consumes)
        self.metrics.lag(0)  # until the first fetch says otherwise

    async def run(self, stop: asyncio.Event) -> None:
        nats_cfg = self.bus.cfg.nats
        queue = None
        while not stop.is_set():
            try:
                # (Re)created after a broker outage: nats-py does not always revive a pull subscription.
                queue = queue or await self.bus.work_queue(self.consumes)
                msgs = await queue.fetch(self.batch, timeout=nats_cfg.fetch_timeout_s)
            except TimeoutError:  # nats' own TimeoutError subclasses it; fetch raises either
                continue
            except NatsError as error:
                log_event(log, "bus_unavailable", level=logging.WARNING, error=repr(error)[:300])
                queue = None
                await asyncio.sleep(1.0)
                continue
            if not msgs:  # fetch can also come back empty-handed
                continue
            # The newest message says how many still wait behind it. A fetch that finds nothing leaves the
            # value as it was: either the queue drained (its last message said 0) or the consumer is at
            # max_ack_pending, when the old value is the better guess.
            self.metrics.lag(msgs[-1].metadata.num_pending)
            fetched_at = time.perf_counter()
            received = [self._receive(msg, fetched_at) for msg in msgs]
            try:
                decoded: list[Received[In]] = []
                for one in received:
                    delivered = one.msg.metadata.num_delivered
                    try:
                        if delivered > nats_cfg.max_deliver:
                            raise Unsettled(
                                f"delivered {delivered} times without an outcome: a {self.bus.service} crashed or hung on it"
                            )
                        one.item = await self.bus.decode(one.msg, self.input_kind)
                    except (DecodeError, Unsettled) as error:
                        cause = "max_deliver" if isinstance(error, Unsettled) else "undecodable"
                        with trace.use_span(one.span, end_on_exit=False):
                            await self.bus.dead_letter(one.msg, str(error), self.consumes, cause=cause)
                            await one.msg.term()
                        self._settle(one, "dead", error)
                        continue
                    except StoreUnavailable as error:
                        log_event(log, "claim_unavailable", level=logging.WARNING, error=str(error))
                        await one.msg.nak(delay=5.0)
                        self._settle(one, "retry", error)
                        continue
                    one.span.set_attribute("rlpipe.group_id", one.item.group_id)
                    decoded.append(one)
                if decoded:
                    async with heartbeat([one.msg for one in decoded], nats_cfg.heartbeat_s):
                        await self._process(decoded)
            finally:
                # Only reached unsettled by an exception (a broker error, cancellation): unacked, it is redelivered.
                for one in received:
                    if not one.settled:
                        self._settle(one, "retry")

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
        self.metrics.settled(outcome, time.perf_counter() - one.fetched_at)
        one.span.set_attribute("rlpipe.outcome", outcome)
        if error is not None:
            one.span.record_exception(error)
            if outcome == "dead":
                one.span.set_status(StatusCode.ERROR, repr(error)[:300])
        one.span.end()

    async def _process(self, decoded: list[Received[In]]) -> None:
        try:
            outputs = await self.compute([one.item for one in decoded])
        except Exception as error:
            if len(decoded) == 1:
                await self._failed(decoded[0], error)
                return
            log_event(log, "batch_failed", level=logging.WARNING, error=repr(error), size=len(decoded))
            for one in decoded:
                await self._process([one])
            return
        for one, output in zip(decoded, outputs, strict=True):
            one.span.add_event("computed", {"rlpipe.batch_size": len(decoded)})
            with trace.use_span(one.span, end_on_exit=False):
                try:
                    await self.bus.publish(self.produces, output, msg_id=f"{output.group_id}.{self.name}")
                    await one.msg.ack_sync()
                except (NatsError, TimeoutError) as error:
                    # Unacked, the input is redelivered after AckWait; a publish that did land is deduplicated.
                    log_event(
                        log, "publish_failed", level=logging.WARNING, group_id=output.group_id, error=repr(error)[:300]
                    )
                    self._settle(one, "retry", error)
                    continue
            self.handled += 1
            self._settle(one, "ok")

    async def _failed(self, one: Received[In], error: Exception) -> None:
        msg = one.msg
        delivered = msg.metadata.num_delivered
        with trace.use_span(one.span, end_on_exit=False):
            if delivered >= self.bus.cfg.nats.max_deliver:
                await self.bus.dead_letter(
                    msg, f"failed {delivered} times, last: {error!r}", self.consumes, cause="max_deliver"
                )
                await msg.term()
                self._settle(one, "dead", error)
            else:
                log_event(log, "compute_failed", level=logging.WARNING, error=repr(error), delivered=delivered)
                await msg.nak(delay=min(2.0**delivered, 30.0))
                self._settle(one, "retry", error)
