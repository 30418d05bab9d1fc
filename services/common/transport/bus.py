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
``services.common.observe.telemetry``), so one group's work across services is one trace.

Broker state. The trainer owns the streams: its bus creates them (or updates one whose
settings changed) at connect and again after every reconnect, so a broker that came
back without its store gets them back. A stage's bus only looks them up, at connect and
after a reconnect, and waits while one is missing (``await_run_state``: the trainer not
up yet, or not yet back), whatever order the services start in; its key may not create,
update or delete a stream (``services.common.transport.nats_auth``). Each stage ensures its own
work queue's durable consumer, at first use and after every reconnect. A consumer whose
settings differ from the config is updated in place (ack_wait, max_deliver,
max_ack_pending); a difference JetStream cannot update refuses the stage's start with
``ConsumerSettingsConflict`` naming the field (exit 2, which the launcher does not restart). So does a
``nats.max_message_bytes`` above the broker's ``max_payload``, checked at every connect.
A broker that lost messages is never read past silently: ``StreamReader.next`` raises ``StreamGap`` when
the next message present is beyond the expected sequence (EXPERIENCE is purged only
below its reader, so any jump is a loss; DEAD is not: its letters age out and an operator may
delete one, so its reader steps over holes) and ``BrokerStateLost`` when the stream was
re-created or ends below what was already read; ``Bus.check_covers`` makes the same
check for a checkpoint's sequence. Both are meant to stop the reader, not be retried.

Bad message or dependency down. A message that is itself bad (undecodable, failing
validation, a compute that raises anything but ``DependencyUnavailable``) spends its
deliveries and goes to DEAD with the reason. A dependency outage consumes no delivery:
when reading or storing a claim-checked body fails (``StoreUnavailable``), the compute
raises ``DependencyUnavailable`` (a dead engine), or the downstream publish fails, the
stage keeps the messages it holds, tells JetStream they are in progress, and retries
the failed step with exponential backoff behind a ``CircuitBreaker``. While the stage
holds them it fetches nothing, so the rest wait in the stream, undelivered; the
breaker's state is the ``rlpipe_stage_breaker_state`` gauge, and an outage longer than
``ack_wait_s * max_deliver`` (when it would have dead-lettered before) logs an alert.
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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum, IntEnum
from typing import Generic, TypeVar

import nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import MsgAlreadyAckdError, NotJSMessageError
from nats.js import api
from nats.js.errors import APIError, BadRequestError, NotFoundError
from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from services.common.config import NatsConfig, RunConfig
from services.common.observe.logs import log_event
from services.common.observe.telemetry import StageMetrics, inject_trace, record_dead_letter, start_span_from_headers
from services.common.refusal import StartRefused
from services.common.transport.messages import ClaimCheck, DecodeError, Message, decode, dedupe_id, encode
from services.common.transport.nats_connect import (
    await_run_state,
    connect_options,
    creates_run_state,
    message_limit_refusal,
)
from services.common.transport.storage import ObjectStore, open_store

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
# The trainer incarnation that fed the group (Prompt.incarnation), on every published group and carried into its
# dead letter, so a trainer settles only its own incarnation's dead letters.
H_INCARNATION = "Rlpipe-Incarnation"
# On a DEAD message that is not a dead letter but the record of a re-inject (``rlpipe dead-letters --reinject``):
# the DEAD sequence of the letter sent back. The trainer reopens the letter's group when it reads it.
H_REINJECTED = "Rlpipe-Reinjected"

log = logging.getLogger(__name__)

In = TypeVar("In", bound=Message)
Out = TypeVar("Out", bound=Message)
T = TypeVar("T")

# JetStream's error codes for "no such stream" (a 404 like "no message at that sequence", which is not a loss).
STREAM_NOT_FOUND = 10059
# Consumer settings JetStream updates in place on a durable; any other difference needs a new consumer.
UPDATABLE_CONSUMER_FIELDS = ("ack_wait", "max_deliver", "max_ack_pending")
COMPARED_CONSUMER_FIELDS = ("ack_policy", "replay_policy", *UPDATABLE_CONSUMER_FIELDS)
# Dependency outages: first retry after BACKOFF_S, doubling up to the breaker's cool-down; BREAKER_THRESHOLD
# failures in a row open the breaker, which then lets one try through every BREAKER_COOLDOWN_S.
BACKOFF_S = 0.5
BREAKER_THRESHOLD = 3
BREAKER_COOLDOWN_S = 10.0
# How often an idle StreamReader re-checks that its stream is still the one it has been reading.
READER_VERIFY_S = 2.0


def stall_bound_s(nats_cfg: NatsConfig) -> float:
    """Seconds without progress after which a stage's loop counts as stuck: a compute is abandoned after
    ``max_work_s``, so twice that (plus a fetch) means even abandoning it did not free the loop."""
    return 2 * nats_cfg.max_work_s + nats_cfg.fetch_timeout_s


class BrokerStateLost(RuntimeError):
    """The broker no longer holds messages this run already wrote or read: stop, do not skip or wait.

    Raised when a stream is missing, was re-created, or ends below a sequence already read
    (a broker that came back without its store, or lost unsynced writes).
    """

    def __init__(self, stream: str, detail: str):
        super().__init__(f"stream {stream}: {detail}")
        self.stream = stream


class StreamGap(BrokerStateLost):
    """The messages of ``stream`` from ``expected`` up to ``found`` (exclusive) are gone."""

    def __init__(self, stream: str, expected: int, found: int):
        super().__init__(
            stream,
            f"expected sequence {expected} next but the next message present is {found}: "
            f"sequences {expected}..{found - 1} were lost",
        )
        self.expected = expected
        self.found = found


class ConsumerSettingsConflict(StartRefused):
    """A durable consumer's settings differ from the config in a way JetStream cannot update in place."""

    def __init__(self, stream: str, consumer: str, differences: dict[str, tuple[object, object]], detail: str = ""):
        listed = ", ".join(f"{name}: {old!r} on the broker, {new!r} wanted" for name, (old, new) in differences.items())
        super().__init__(
            f"consumer {consumer} of {stream} cannot be updated ({listed}){': ' + detail if detail else ''}; "
            "delete it (nats consumer rm) once its messages are handled, or restore the old setting"
        )
        self.stream = stream
        self.consumer = consumer
        self.differences = differences


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
        self.creates_streams = creates_run_state(service)  # the trainer; a stage waits for them instead
        self.nc: nats.NATS | None = None
        self.js: nats.js.JetStreamContext | None = None
        # Bumped the moment the connection comes back, before streams are restored: a reader seeing it
        # change re-checks its stream before trusting what it reads next.
        self.reconnects = 0
        self._work_queues: set[str] = set()  # edges whose durable consumer this bus made, restored on reconnect
        self._reconnect_listeners: list[Callable[[], Awaitable[None]]] = []
        self._restore: asyncio.Task[None] | None = None

    async def connect(self) -> Bus:
        self.nc = await nats.connect(
            self.cfg.nats.url,
            name=f"{self.run_id}-{self.service}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            reconnected_cb=self._reconnected,
            **connect_options(self.cfg.nats, self.service),
        )
        refusal = message_limit_refusal(self.cfg.nats.max_message_bytes, self.nc.max_payload)
        if refusal:  # the broker would refuse every message between the two limits, a large group the first
            await self.nc.close()
            raise StartRefused(refusal)
        self.js = self.nc.jetstream()
        await self._streams_in_place()
        return self

    async def close(self) -> None:
        if self._restore is not None:
            self._restore.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restore
        if self.nc is not None and not self.nc.is_closed:
            # Not drain(): unacked work simply redelivers, and a pending pull would stall the drain.
            await self.nc.close()

    def on_reconnect(self, listener: Callable[[], Awaitable[None]]) -> None:
        """Call ``listener`` after each reconnect, once streams and consumers are restored (e.g. to ``check_covers``).

        It runs in a task of its own: what it raises is logged, so a listener that must stop its
        service should set that service's stop event (or record the error) itself.
        """
        self._reconnect_listeners.append(listener)

    async def _reconnected(self) -> None:
        # nats-py awaits this inside its reconnection task: JetStream requests made here would hold that task
        # (and a broker still recovering could hang it), so the restore runs as a task of its own.
        self.reconnects += 1
        log_event(log, "bus_reconnected", reconnects=self.reconnects)
        if self._restore is not None:
            self._restore.cancel()
        self._restore = asyncio.get_running_loop().create_task(self._restore_state())

    async def _restore_state(self) -> None:
        """Streams and consumers back in place after a reconnect: a broker that lost its store has none (the trainer
        re-creates the streams, a stage waits for them and then re-creates its consumer)."""
        delay = 0.2
        while True:
            try:
                await self._streams_in_place()
                for edge in sorted(self._work_queues):
                    await self.ensure_consumer(edge)
                break
            except (NatsError, TimeoutError) as error:  # JetStream may still be recovering: try again
                log_event(log, "bus_restore_retry", level=logging.WARNING, error=repr(error)[:300], retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            except ConsumerSettingsConflict as error:  # someone changed the consumer by hand meanwhile
                log_event(log, "bus_restore_failed", level=logging.ERROR, alert=True, error=str(error))
                return
        log_event(log, "bus_restored", streams=len(EDGES), consumers=sorted(self._work_queues))
        for listener in self._reconnect_listeners:
            try:
                await listener()
            except Exception as error:
                log_event(log, "reconnect_listener_failed", level=logging.ERROR, error=repr(error)[:500])

    async def check_covers(
        self, edge: str, seq: int, created: datetime | None = None, contiguous: bool = True
    ) -> api.StreamInfo:
        """Raise ``BrokerStateLost`` unless ``edge``'s stream still holds what reading up to ``seq`` implies.

        ``seq`` is the last sequence already read (a checkpoint's last applied EXPERIENCE sequence).
        Lost when the stream is missing, ends below ``seq`` (re-created, or unsynced writes lost),
        or was created at another time than ``created`` (from ``stream_created`` when the reading
        began), and ``StreamGap`` when the messages right after ``seq`` are gone while later ones
        remain (unless ``contiguous`` is False: DEAD, whose oldest letters age out and from which an
        operator may delete). Connection failures propagate as they are (NatsError, TimeoutError): not
        a verdict. Returns the stream's info.
        """
        name = stream_name(self.run_id, edge)
        info = await self._stream_info(name)
        state = info.state
        if state.last_seq < seq:
            raise BrokerStateLost(
                name,
                f"ends at sequence {state.last_seq} but sequence {seq} was already read: "
                "the broker lost its messages (restarted without its store, or unsynced writes lost)",
            )
        if created is not None and info.created is not None and info.created != created:
            raise BrokerStateLost(
                name, f"was re-created at {info.created.isoformat()} (read since {created.isoformat()})"
            )
        # After a purge of everything up to seq, first_seq is seq + 1; anything later means lost messages.
        if contiguous and state.messages and state.first_seq > seq + 1:
            raise StreamGap(name, seq + 1, state.first_seq)
        return info

    async def stream_created(self, edge: str) -> datetime | None:
        """When ``edge``'s stream was created: a stream lost and re-created gets a new time (see ``check_covers``)."""
        return (await self._stream_info(stream_name(self.run_id, edge))).created

    async def _stream_info(self, name: str) -> api.StreamInfo:
        try:
            return await self.js.stream_info(name)
        except NotFoundError as error:
            raise BrokerStateLost(name, f"does not exist on the broker ({error.description})") from None

    def stream_config(self, edge: str) -> api.StreamConfig:
        nats_cfg = self.cfg.nats
        return api.StreamConfig(
            name=stream_name(self.run_id, edge),
            subjects=[subject(self.run_id, edge)],
            retention=api.RetentionPolicy.WORK_QUEUE if edge in WORK_QUEUES else api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE if nats_cfg.storage == "file" else api.StorageType.MEMORY,
            duplicate_window=nats_cfg.duplicate_window_s,
            num_replicas=nats_cfg.stream_replicas,
            # DEAD is the only stream nothing else purges; EXPERIENCE is purged by the trainer after each save.
            max_age=nats_cfg.dead_letter_max_age_s if edge == DEAD else None,
        )

    async def _streams_in_place(self) -> None:
        await (self.ensure_streams() if self.creates_streams else self.await_streams())

    async def await_streams(self) -> None:
        """Return once every stream of the run exists, waiting (and saying so) while the trainer has not made one."""
        for edge in EDGES:
            name = stream_name(self.run_id, edge)
            await await_run_state(f"stream {name}", functools.partial(self.js.stream_info, name), NotFoundError)

    async def ensure_streams(self) -> None:
        """Create the run's streams, or bring one whose settings changed up to date: the trainer's part."""
        for edge in EDGES:
            config = self.stream_config(edge)
            try:
                await self.js.add_stream(config)
            except BadRequestError:
                # Exists with other settings (e.g. a changed duplicate window): bring it up to date.
                await self.js.update_stream(config)

    async def decode(self, msg: Msg | StreamMessage, kind: type[In]) -> In:
        """Validate a received message as ``kind`` (fetching a claim-checked body); DecodeError says why it is bad."""
        limit = self.cfg.nats.max_message_bytes
        if len(msg.data) > limit:
            raise DecodeError(f"message of {len(msg.data)} bytes exceeds nats.max_message_bytes={limit}")
        if msg.headers and msg.headers.get(H_CLAIM):
            claim = decode(msg.data, ClaimCheck)
            check_claim(claim, self.run_id, self.cfg.nats.max_claim_bytes)
            try:
                # Off the event loop: a slow store must not stall acks, heartbeats and admin calls. One byte past
                # the declared size is enough to see that a stored body is longer than its claim.
                data = await asyncio.to_thread(lambda: self.claims.get(claim.key, limit=claim.size + 1))
            except FileNotFoundError as error:
                raise DecodeError(f"claim-checked body {claim.key} is missing: {error}") from None
            except Exception as error:  # the store's many failure types: unreachable, refused, timed out
                raise StoreUnavailable(f"claim-checked body {claim.key} could not be read: {error!r}"[:500]) from error
            if len(data) != claim.size or hashlib.sha256(data).hexdigest() != claim.sha256:
                raise DecodeError(f"claim-checked body {claim.key} does not match its size and hash")
            return decode(data, kind)
        return decode(msg.data, kind)

    def claim_key(self, msg: Msg | StreamMessage) -> str | None:
        """The object-store key of a claim-checked message's body; None for an ordinary message or a bad key."""
        run_id = self.run_id
        if not (msg.headers and msg.headers.get(H_CLAIM)):
            return None
        try:
            claim = decode(msg.data, ClaimCheck)
        except DecodeError:
            return None
        return claim.key if claim_key_fault(claim.key, run_id) is None else None

    async def publish(self, edge: str, message: Message, msg_id: str) -> api.PubAck:
        """Publish and wait for the stream's ack; a repeat of ``msg_id`` inside the window is dropped.

        A body above ``nats.claim_check_bytes`` is stored in the object store first and the
        message carries its key (claim check), keeping payloads well under the server's limit.
        """
        headers = inject_trace({"Nats-Msg-Id": msg_id, H_SERVICE: self.service})
        group_id = getattr(message, "group_id", None)
        if group_id:
            headers[H_GROUP] = group_id
        incarnation = getattr(message, "incarnation", "")
        if incarnation:
            headers[H_INCARNATION] = incarnation
        data = encode(message)
        if len(data) > self.cfg.nats.claim_check_bytes:
            sha256 = hashlib.sha256(data).hexdigest()
            # Keyed by content too: a redelivered compute's body (a new sample) must not overwrite the body of
            # the message the stream kept, whose repeat the duplicate window drops.
            key = f"{claim_prefix(self.run_id)}{edge}/{msg_id}-{sha256[:16]}"
            try:
                await asyncio.to_thread(lambda: self.claims.put(key, data))
            except Exception as error:  # S3 errors, refused or timed-out connections: the store, not the message
                raise StoreUnavailable(f"claim-checked body {key} could not be stored: {error!r}"[:500]) from error
            data = encode(ClaimCheck(key=key, size=len(data), sha256=sha256))
            headers[H_CLAIM] = "1"
        return await self.js.publish(subject(self.run_id, edge), data, headers=headers, timeout=10)

    @functools.cached_property
    def claims(self) -> ObjectStore:
        return open_store(self.cfg.checkpoint_url, self.cfg.checkpoint)

    async def dead_letter(self, msg: Msg | StreamMessage, reason: str, edge: str, cause: str = "undecodable") -> None:
        """Copy ``msg`` to DEAD with why and where from; the caller terminates it upstream.

        The group id, claim check and incarnation headers travel with it. Broker failures propagate (NatsError,
        TimeoutError): a stage retries them as an outage (``Stage._on_broker``), never as the message's fault.

        ``cause`` is the reason's class for metrics (``undecodable``, ``max_deliver`` or ``timeout``):
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
        for carried in (H_GROUP, H_CLAIM, H_INCARNATION):
            if msg.headers and carried in msg.headers:
                headers[carried] = msg.headers[carried]
        await self.js.publish(subject(self.run_id, DEAD), msg.data, headers=headers, timeout=10)
        record_dead_letter(self.service, edge, cause)
        log_event(log, "dead_letter", level=logging.WARNING, edge=edge, seq=sequence, reason=reason[:300])

    def consumer_config(self, edge: str) -> api.ConsumerConfig:
        nats_cfg = self.cfg.nats
        durable = WORK_QUEUES[edge]
        return api.ConsumerConfig(
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            replay_policy=api.ReplayPolicy.INSTANT,  # the default, named so a durable made otherwise is caught
            ack_wait=nats_cfg.ack_wait_s,
            # One delivery more than a compute may fail: a message whose earlier deliveries never came
            # back (the service crashed or hung on it) is dead-lettered on it instead of dropped silently.
            max_deliver=nats_cfg.max_deliver + 1,
            max_ack_pending=nats_cfg.max_ack_pending,
        )

    async def ensure_consumer(self, edge: str) -> api.ConsumerInfo:
        """The durable consumer of ``edge`` with the configured settings, created or updated in place.

        nats-py alone would keep a durable's old settings (a raised max_deliver would never reach the
        broker and messages would drop out after the old count). A difference JetStream cannot update
        raises ``ConsumerSettingsConflict`` naming the field, its value on the broker and the wanted one.
        """
        stream, wanted = stream_name(self.run_id, edge), self.consumer_config(edge)
        try:
            info = await self.js.consumer_info(stream, wanted.durable_name)
        except NotFoundError:
            return await self.js.add_consumer(stream, wanted)
        differences = {
            name: (getattr(info.config, name), getattr(wanted, name))
            for name in COMPARED_CONSUMER_FIELDS
            if not _same_setting(getattr(info.config, name), getattr(wanted, name))
        }
        if not differences:
            return info
        fixed = {name: change for name, change in differences.items() if name not in UPDATABLE_CONSUMER_FIELDS}
        if fixed:
            raise ConsumerSettingsConflict(
                stream, wanted.durable_name, {name: (_plain(old), _plain(new)) for name, (old, new) in fixed.items()}
            )
        try:
            updated = await self.js.add_consumer(stream, wanted)  # same durable name: the server updates it
        except APIError as error:
            plain = {name: (_plain(old), _plain(new)) for name, (old, new) in differences.items()}
            raise ConsumerSettingsConflict(stream, wanted.durable_name, plain, str(error.description)) from error
        log_event(
            log,
            "consumer_updated",
            stream=stream,
            consumer=wanted.durable_name,
            changes={name: [_plain(old), _plain(new)] for name, (old, new) in differences.items()},
        )
        return updated

    async def work_queue(self, edge: str) -> nats.js.JetStreamContext.PullSubscription:
        """The durable pull consumer of ``edge``, shared by every replica of its consuming role."""
        await self.ensure_consumer(edge)
        self._work_queues.add(edge)
        return await self.js.pull_subscribe_bind(consumer=WORK_QUEUES[edge], stream=stream_name(self.run_id, edge))

    def read_from(self, edge: str, start_seq: int) -> StreamReader:
        """A reader of ``edge`` in stream order from sequence ``start_seq`` on."""
        return StreamReader(self, edge, start_seq)


@dataclass
class StreamMessage:
    sequence: int
    data: bytes
    headers: dict[str, str] | None


def _plain(value: object) -> object:
    return value.value if isinstance(value, Enum) else value


def _same_setting(old: object, new: object) -> bool:
    old, new = _plain(old), _plain(new)
    if isinstance(old, float) or isinstance(new, float):  # durations come back from nanoseconds
        return old is not None and new is not None and abs(float(old) - float(new)) < 1e-6
    return old == new


class StreamReader:
    """Reads a limits-retention stream message by message by sequence number.

    Stateless on the server (direct gets, no consumer), so a broker restart or a lost
    connection costs nothing but a retry, and a restarted trainer simply starts again
    from its checkpoint's sequence.

    It never reads past lost messages: the stream is checked (``Bus.check_covers``) before
    the first read, after every reconnect and every ``READER_VERIFY_S`` while idle, and a
    message found beyond the expected sequence raises ``StreamGap``. So it must only read
    streams nothing deletes from ahead of it: EXPERIENCE (purged below the trainer's
    checkpoints only). DEAD is read the same way except that a hole is no loss there: its oldest
    letters age out (``nats.dead_letter_max_age_s``) and an operator may delete one, so the reader
    steps over missing sequences and only a stream re-created or ending below what it read stops it.
    """

    def __init__(self, bus: Bus, edge: str, start_seq: int):
        self.bus = bus
        self.edge = edge
        self.holes_allowed = edge == DEAD
        self.stream = stream_name(bus.run_id, edge)
        self.subject = subject(bus.run_id, edge)
        self.next_seq = start_seq
        self.created: datetime | None = None  # the stream's creation time when this reader first checked it
        self._verified_reconnects: int | None = None  # bus.reconnects at the last check; None: never checked
        self._verified_at = 0.0

    async def verify(self) -> None:
        """Raise ``BrokerStateLost`` if the stream no longer holds what this reader has read (or starts after)."""
        reconnects = self.bus.reconnects
        info = await self.bus.check_covers(
            self.edge, self.next_seq - 1, self.created, contiguous=not self.holes_allowed
        )
        self.created = self.created or info.created
        self._verified_reconnects = reconnects
        self._verified_at = asyncio.get_running_loop().time()

    async def next(self, timeout: float) -> StreamMessage | None:
        """The next message, or None if none arrives within ``timeout`` seconds.

        Raises ``StreamGap`` / ``BrokerStateLost`` when the broker lost messages at or after the
        expected sequence; the reader stays where it was, so the error repeats on every call.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            raw = None
            try:
                if self._verified_reconnects != self.bus.reconnects:
                    await self.verify()
                raw = await self.bus.js.get_msg(self.stream, seq=self.next_seq, subject=self.subject, next=True)
            except NotFoundError as error:
                if error.err_code == STREAM_NOT_FOUND:
                    raise BrokerStateLost(self.stream, "does not exist on the broker") from None
                # No message at or after next_seq yet. A stream re-created and refilled past next_seq would hand
                # out other messages under the sequences expected, so the idle reader re-checks it now and then.
                if loop.time() - self._verified_at >= READER_VERIFY_S:
                    with contextlib.suppress(NatsError, TimeoutError):
                        await self.verify()
            except (NatsError, TimeoutError) as error:
                log_event(log, "bus_unavailable", level=logging.WARNING, error=repr(error)[:300])
            if raw is not None:
                if raw.seq != self.next_seq and not self.holes_allowed:  # the messages between are lost
                    raise StreamGap(self.stream, self.next_seq, raw.seq)
                self.next_seq = raw.seq + 1
                return StreamMessage(raw.seq, raw.data or b"", dict(raw.headers) if raw.headers else None)
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def heartbeat(msgs: Callable[[], list[Msg]], interval_s: float) -> AsyncIterator[None]:
    """Tell JetStream that ``msgs()`` (asked anew at each beat) are still being worked on: no redelivery."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(interval_s)
            for msg in msgs():
                with contextlib.suppress(Exception):  # a broker away: the beat after it comes back counts
                    await msg.in_progress()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def claim_prefix(run_id: str) -> str:
    """Where a run's claim-checked bodies are stored; a claim pointing anywhere else is refused."""
    return f"{run_id}/claims/"


def claim_key_fault(key: str, run_id: str) -> str | None:
    """What is wrong with a claim's ``key``, which comes from a message and so is trusted with nothing; None if fine.

    It must lie under the run's claim prefix, as plain segments: no absolute path, no ``.`` or ``..``, no empty
    segment, no backslash or NUL, so that no store (a folder joins root / key) reads or deletes outside it.
    """
    prefix = claim_prefix(run_id)
    if not key.startswith(prefix):
        return f"claim key {key[:200]!r} is not under the run's claim prefix {prefix!r}"
    segments = key[len(prefix) :].split("/")
    if any(segment in ("", ".", "..") for segment in segments) or "\\" in key or "\0" in key:
        return f"claim key {key[:200]!r} is not a plain path of named segments under {prefix!r}"
    return None


def check_claim(claim: ClaimCheck, run_id: str, max_bytes: int) -> None:
    """DecodeError unless ``claim`` names a key of this run and a size within ``max_bytes``: the input's fault."""
    fault = claim_key_fault(claim.key, run_id)
    if fault is not None:
        raise DecodeError(fault)
    if not 0 < claim.size <= max_bytes:
        raise DecodeError(
            f"claim-checked body {claim.key} declares {claim.size} bytes; allowed 1 to nats.max_claim_bytes={max_bytes}"
        )


class DependencyUnavailable(Exception):
    """Something the stage depends on (object store, inference engine, broker) failed: the message is fine.

    A compute raises it (``raise DependencyUnavailable(...) from error``) for a failure that says
    nothing about its input; the stage then retries without spending the message's deliveries.
    """


class StoreUnavailable(DependencyUnavailable):
    """The object store holding a claim-checked body did not answer: the message is fine, try it again later."""


class Unsettled(Exception):
    """A message that used up its deliveries without any of them reaching an outcome."""


class WorkTimedOut(Exception):
    """A compute ran past ``nats.max_work_s`` and was abandoned."""


class _Stopping(Exception):
    """The stage was asked to stop while it waited for a dependency."""


class BreakerState(IntEnum):
    """Also the value of the ``rlpipe_stage_breaker_state`` gauge."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Consecutive dependency failures open it; while open nothing is tried; after ``cooldown_s`` one try goes through.

    Closed: each failure waits ``backoff_s * 2**(failures - 1)`` (at most ``cooldown_s``) before the
    next try; ``threshold`` failures in a row open it. Open: tries wait out the cool-down, then the
    breaker is half-open and lets one through: a success closes it, a failure opens it again.
    ``clock`` (seconds, monotonic) is a parameter so the state machine can be tested without sleeping.
    """

    def __init__(
        self,
        threshold: int = BREAKER_THRESHOLD,
        cooldown_s: float = BREAKER_COOLDOWN_S,
        backoff_s: float = BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if threshold < 1 or cooldown_s <= 0 or backoff_s <= 0:
            raise ValueError("threshold must be >= 1 and cooldown_s, backoff_s > 0")
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.backoff_s = backoff_s
        self.clock = clock
        self.failures = 0  # consecutive, since the last success
        self.down_since: float | None = None  # clock at the first failure of the current streak
        self._last_failure = 0.0
        self._opened_at: float | None = None

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self.clock() - self._opened_at >= self.cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def retry_in(self) -> float:
        """Seconds until the next try may go through (0: now)."""
        now = self.clock()
        if self._opened_at is not None:
            return max(0.0, self._opened_at + self.cooldown_s - now)
        if self.failures == 0:
            return 0.0
        backoff = min(self.backoff_s * 2 ** (self.failures - 1), self.cooldown_s)
        return max(0.0, self._last_failure + backoff - now)

    def failed(self) -> None:
        now = self.clock()
        if self.failures == 0:
            self.down_since = now
        self.failures += 1
        self._last_failure = now
        # A failed half-open probe, or the threshold reached: (re)open for a full cool-down.
        if self._opened_at is not None or self.failures >= self.threshold:
            self._opened_at = now

    def trip(self) -> None:
        """A failure that retrying soon would only repeat (a refused token, a wrong URL): open now, below threshold."""
        self.failed()
        self._opened_at = self._last_failure

    def succeeded(self) -> None:
        self.failures = 0
        self.down_since = None
        self._opened_at = None

    def down_for(self) -> float:
        """Seconds since the current streak of failures began (0 when closed and healthy)."""
        return 0.0 if self.down_since is None else self.clock() - self.down_since


def _unsettled(received: list[Received]) -> list[Msg]:
    return [one.msg for one in received if not one.settled]


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


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
    breaker: CircuitBreaker = field(init=False)  # over every dependency of the stage: claim store, compute, broker
    _alerted: bool = field(init=False, default=False)  # the current outage has raised its alert
    _last_error: str = field(init=False, default="")
    last_progress: float = field(init=False, default_factory=time.time)  # wall time; see the module docstring

    def stalled_for(self, now: float) -> float:
        """Seconds the loop has gone without progress beyond ``stall_bound_s`` (0 while it is moving)."""
        return max(0.0, now - self.last_progress - stall_bound_s(self.bus.cfg.nats))

    def __post_init__(self) -> None:
        self.metrics = StageMetrics(self.bus.service, self.consumes)
        self.metrics.lag(0)  # until the first fetch says otherwise
        self.metrics.watch_progress(self.stalled_for)
        self.breaker = CircuitBreaker()
        self.metrics.breaker(BreakerState.CLOSED)

    async def run(self, stop: asyncio.Event) -> None:
        nats_cfg = self.bus.cfg.nats
        queue = None
        while not stop.is_set():
            try:
                # (Re)created after a broker outage: nats-py does not always revive a pull subscription.
                queue = queue or await self.bus.work_queue(self.consumes)
                msgs = await queue.fetch(self.batch, timeout=nats_cfg.fetch_timeout_s)
            except TimeoutError:  # nats' own TimeoutError subclasses it; fetch raises either
                self.last_progress = time.time()
                continue
            except NatsError as error:
                log_event(log, "bus_unavailable", level=logging.WARNING, error=repr(error)[:300])
                queue = None
                await asyncio.sleep(1.0)
                continue
            self.last_progress = time.time()
            if not msgs:  # fetch can also come back empty-handed
                continue
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
            except _Stopping:
                # Stopped during an outage: hand the held messages back now rather than after AckWait.
                for one in received:
                    if not one.settled:
                        with contextlib.suppress(NatsError, TimeoutError):
                            await one.msg.nak()
                        self._settle(one, "retry")
            finally:
                # Only reached unsettled by an exception (a broker error, cancellation): unacked, it is redelivered.
                for one in received:
                    if not one.settled:
                        self._settle(one, "retry")

    async def _handle(self, received: list[Received[In]], stop: asyncio.Event) -> None:
        nats_cfg = self.bus.cfg.nats
        decoded: list[Received[In]] = []
        for one in received:
            delivered = one.msg.metadata.num_delivered
            try:
                if delivered > nats_cfg.max_deliver:
                    raise Unsettled(
                        f"delivered {delivered} times without an outcome: a {self.bus.service} crashed or hung on it"
                    )
                # A claim store that is down holds the message here (StoreUnavailable), spending no delivery.
                one.item = await self._available(
                    functools.partial(self.bus.decode, one.msg, self.input_kind), "claim_read", stop
                )
            except (DecodeError, Unsettled) as error:
                cause = "max_deliver" if isinstance(error, Unsettled) else "undecodable"
                with trace.use_span(one.span, end_on_exit=False):
                    dead_letter = functools.partial(self.bus.dead_letter, one.msg, str(error), self.consumes, cause)
                    await self._on_broker(dead_letter, "dead_letter", stop)
                    await self._on_broker(one.msg.term, "term", stop)
                self._settle(one, "dead", error)
                continue
            one.span.set_attribute("rlpipe.group_id", one.item.group_id)
            decoded.append(one)
        if decoded:
            await self._process(decoded, stop)

    async def _available(self, attempt: Callable[[], Awaitable[T]], step: str, stop: asyncio.Event) -> T:
        """``attempt()``'s result, retried behind the breaker for as long as it raises ``DependencyUnavailable``.

        Raises ``_Stopping`` when ``stop`` is set while a dependency is down; with every dependency
        up, a stop lets the current batch finish as before.
        """
        while True:
            # Waits in short slices: the alert is due once the outage passes its bound, not at the next try.
            while (wait := self.breaker.retry_in()) > 0 and not stop.is_set():
                await _sleep_unless(stop, min(wait, 1.0))
                self._maybe_alert(step)
            self.metrics.breaker(self.breaker.state)
            self.last_progress = time.time()  # waiting out an outage is the loop at work, not stuck
            if stop.is_set() and self.breaker.failures:
                raise _Stopping
            try:
                result = await attempt()
            except DependencyUnavailable as error:
                self._dependency_failed(step, error)
                continue
            if self.breaker.failures:
                self._dependency_recovered(step)
            return result

    def _dependency_failed(self, step: str, error: DependencyUnavailable) -> None:
        self.breaker.failed()
        state = self.breaker.state
        self.metrics.breaker(state)
        log_event(
            log,
            "dependency_unavailable",
            level=logging.WARNING,
            step=step,
            breaker=state.name.lower(),
            failures=self.breaker.failures,
            retry_s=round(self.breaker.retry_in(), 2),
            error=repr(error)[:300],
        )
        self._last_error = repr(error)[:300]
        self._maybe_alert(step)

    def _maybe_alert(self, step: str) -> None:
        nats_cfg = self.bus.cfg.nats
        # The time after which the old rule (nak, spend a delivery) would have dead-lettered healthy messages.
        bound = nats_cfg.ack_wait_s * nats_cfg.max_deliver
        if not self._alerted and self.breaker.failures and self.breaker.down_for() >= bound:
            self._alerted = True
            log_event(
                log,
                "dependency_down",
                level=logging.ERROR,
                alert=True,
                step=step,
                down_s=round(self.breaker.down_for(), 1),
                error=self._last_error,
            )

    def _dependency_recovered(self, step: str) -> None:
        down_s = round(self.breaker.down_for(), 1)
        self.breaker.succeeded()
        self.metrics.breaker(BreakerState.CLOSED)
        if self._alerted:
            self._alerted = False
            log_event(log, "dependency_recovered", step=step, down_s=down_s, alert=False)
        else:
            log_event(log, "dependency_recovered", step=step, down_s=down_s)

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

        return await self._available(attempt, step, stop)

    async def _publish(self, output: Out) -> api.PubAck:
        try:
            return await self.bus.publish(self.produces, output, msg_id=dedupe_id(output, self.name))
        except (NatsError, TimeoutError) as error:
            # The broker, not the message: retried with the output in hand, so the compute is not repeated.
            raise DependencyUnavailable(f"publish to {self.produces} failed: {error!r}") from error

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
            outputs = await self._available(
                functools.partial(self._capped_compute, [one.item for one in decoded]), "compute", stop
            )
        except _Stopping:
            raise
        except WorkTimedOut as error:  # abandoned whole: splitting would wait max_work_s per message
            log_event(log, "work_timed_out", level=logging.WARNING, error=str(error), size=len(decoded))
            for one in decoded:
                await self._failed(one, error, stop)
            return
        except Exception as error:  # the inputs' fault: find the bad one(s)
            if len(decoded) == 1:
                await self._failed(decoded[0], error, stop)
                return
            log_event(log, "batch_failed", level=logging.WARNING, error=repr(error), size=len(decoded))
            for one in decoded:
                await self._process([one], stop)
            return
        for one, output in zip(decoded, outputs, strict=True):
            one.span.add_event("computed", {"rlpipe.batch_size": len(decoded)})
            with trace.use_span(one.span, end_on_exit=False):
                await self._available(functools.partial(self._publish, output), "publish", stop)
                try:
                    await one.msg.ack_sync()
                except (NatsError, TimeoutError) as error:
                    # Unacked, the input is redelivered after AckWait; its repeat publish is deduplicated.
                    log_event(
                        log, "ack_failed", level=logging.WARNING, group_id=output.group_id, error=repr(error)[:300]
                    )
                    self._settle(one, "retry", error)
                    continue
            self.handled += 1
            self._settle(one, "ok")

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

    async def _failed(self, one: Received[In], error: Exception, stop: asyncio.Event) -> None:
        msg = one.msg
        delivered = msg.metadata.num_delivered
        with trace.use_span(one.span, end_on_exit=False):
            if delivered >= self.bus.cfg.nats.max_deliver:
                if isinstance(error, WorkTimedOut):
                    reason, cause = f"timeout: {error} on each of {delivered} deliveries", "timeout"
                else:
                    reason, cause = f"failed {delivered} times, last: {error!r}", "max_deliver"
                await self._on_broker(
                    functools.partial(self.bus.dead_letter, msg, reason, self.consumes, cause), "dead_letter", stop
                )
                await self._on_broker(msg.term, "term", stop)
                self._settle(one, "dead", error)
            else:
                log_event(log, "compute_failed", level=logging.WARNING, error=repr(error), delivered=delivered)
                await self._on_broker(functools.partial(msg.nak, delay=min(2.0**delivered, 30.0)), "nak", stop)
                self._settle(one, "retry", error)
