"""The JetStream bus: a connection to NATS with the run's streams and consumers in place, and the calls that move
messages on it (publish, decode, dead-letter). The streams' names are in ``streams``, the loop that consumes a work
queue in ``stage``, ordered reading by sequence in ``reader``, claim-checked bodies in ``claims``.

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
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from enum import Enum
from typing import TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, BadRequestError, NotFoundError

from services.common.cancel import cancel_until_done
from services.common.config import RunConfig
from services.common.observe.events import Event
from services.common.observe.instruments import record_dead_letter
from services.common.observe.logs import log_event
from services.common.observe.network import watch_network_bytes
from services.common.observe.telemetry import inject_trace
from services.common.refusal import StartRefused
from services.common.transport.claims import (
    check_claim,
    claimed_key,
    is_claim_checked,
    read_claimed,
    store_claimed,
)
from services.common.transport.dead_letters import dead_letter_id, letter_headers
from services.common.transport.messages import ClaimCheck, DecodeError, Message, decode, encode
from services.common.transport.nats_connect import (
    await_run_state,
    broker_version_refusal,
    connect_options,
    creates_run_state,
    message_limit_refusal,
)
from services.common.transport.reader import StreamReader
from services.common.transport.storage import ObjectStore, open_store
from services.common.transport.streams import (
    DEAD,
    EDGES,
    H_CLAIM,
    H_GROUP,
    H_INCARNATION,
    H_SERVICE,
    WORK_QUEUES,
    BrokerStateLost,
    StreamGap,
    StreamMessage,
    dead_subject,
    stream_name,
    stream_subjects,
    subject,
)
from services.common.transport.work_queues import groups_queued

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

# Consumer settings JetStream updates in place on a durable; any other difference needs a new consumer.
UPDATABLE_CONSUMER_FIELDS = ("ack_wait", "max_deliver", "max_ack_pending")
COMPARED_CONSUMER_FIELDS = ("ack_policy", "replay_policy", *UPDATABLE_CONSUMER_FIELDS)


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


class Bus:
    """A connection to NATS with the run's streams in place."""

    def __init__(self, cfg: RunConfig, service: str):
        self.cfg = cfg
        self.service = service
        self.run_id = cfg.run_id
        self.creates_streams = creates_run_state(service)  # the trainer; a stage waits for them instead
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        # Bumped once nats-py calls back after a reconnect, before streams are restored: a reader seeing it
        # change re-checks its stream before trusting what it reads next.
        self.reconnects = 0
        self._work_queues: set[str] = set()  # edges whose durable consumer this bus made, restored on reconnect
        self._reconnect_listeners: list[Callable[[], Awaitable[None]]] = []
        self._restores: set[asyncio.Task[None]] = set()  # after each reconnect; a newer one supersedes the others

    @property
    def nc(self) -> NATS:
        """The connection to NATS (``connect`` comes first)."""
        if self._nc is None:
            raise RuntimeError(f"the {self.service}'s bus is not connected: Bus.connect comes first")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        """The connection's JetStream context (``connect`` comes first)."""
        if self._js is None:
            raise RuntimeError(f"the {self.service}'s bus is not connected: Bus.connect comes first")
        return self._js

    async def connect(self) -> Bus:
        nc = self._nc = await nats.connect(
            self.cfg.nats.url,
            name=f"{self.run_id}-{self.service}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            reconnected_cb=self._reconnected,
            **connect_options(self.cfg.nats, self.service),
        )
        refusal = broker_version_refusal(nc.connected_server_version) or message_limit_refusal(
            self.cfg.nats.max_message_bytes, nc.max_payload
        )
        if refusal:  # too old for batched reads, or it would refuse every message between the two size limits
            await nc.close()
            raise StartRefused(refusal)
        self._js = nc.jetstream()
        # Payload bytes as nats-py counts them, across reconnects (the client's stats outlive its connections).
        stats = nc.stats
        watch_network_bytes(self.service, "bus", "in", lambda: stats["in_bytes"])
        watch_network_bytes(self.service, "bus", "out", lambda: stats["out_bytes"])
        await self._streams_in_place()
        return self

    async def close(self) -> None:
        # Ended before the connection closes, each cancelled until it ends: a restore retries while a stream is
        # missing, so one that dropped a single cancellation would hold this close (and the service's exit) up.
        # Asked anew each round: a reconnect while they end starts another. Done ones are left out here rather than
        # trusted to have been discarded by their callback already.
        while running := [restore for restore in self._restores if not restore.done()]:
            await cancel_until_done(*running)
        if self._nc is not None and not self._nc.is_closed:
            # Not drain(): unacked work simply redelivers, and a pending pull would stall the drain.
            await self._nc.close()

    @property
    def connections(self) -> int:
        """Reconnects as nats-py counts them the moment one happens, before it replays subscriptions and so before
        any reply arrives over the new connection (``reconnects`` follows only after a round trip)."""
        return self.nc.stats["reconnects"]

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
        log_event(log, Event.BUS_RECONNECTED, reconnects=self.reconnects)
        for superseded in self._restores:
            superseded.cancel()  # once is enough here: close() makes sure every one has ended
        restore = asyncio.get_running_loop().create_task(self._restore_state())
        self._restores.add(restore)
        restore.add_done_callback(self._restore_ended)

    def _restore_ended(self, restore: asyncio.Task[None]) -> None:
        self._restores.discard(restore)
        if not restore.cancelled() and (error := restore.exception()) is not None:
            log_event(log, Event.BUS_RESTORE_FAILED, level=logging.ERROR, alert=True, error=repr(error)[:300])

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
                log_event(log, Event.BUS_RESTORE_RETRY, level=logging.WARNING, error=repr(error)[:300], retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            except ConsumerSettingsConflict as error:  # someone changed the consumer by hand meanwhile
                log_event(log, Event.BUS_RESTORE_FAILED, level=logging.ERROR, alert=True, error=str(error))
                return
        log_event(log, Event.BUS_RESTORED, streams=len(EDGES), consumers=sorted(self._work_queues))
        for listener in self._reconnect_listeners:
            try:
                await listener()
            except Exception as error:
                log_event(log, Event.RECONNECT_LISTENER_FAILED, level=logging.ERROR, error=repr(error)[:500])

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
            # DEAD's are every role's own and the bare one an older build wrote to (an older run's stream gets the
            # roles' when the trainer updates it, ``ensure_streams``).
            subjects=stream_subjects(self.run_id, edge),
            retention=api.RetentionPolicy.WORK_QUEUE if edge in WORK_QUEUES else api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE if nats_cfg.storage == "file" else api.StorageType.MEMORY,
            duplicate_window=nats_cfg.duplicate_window_s,
            num_replicas=nats_cfg.stream_replicas,
            # DEAD is the only stream nothing else purges; EXPERIENCE is purged by the trainer after each save.
            max_age=nats_cfg.dead_letter_max_age_s if edge == DEAD else None,
            # StreamReader reads ahead in batched direct gets (services/common/transport/reader.py).
            allow_direct=True,
        )

    async def _streams_in_place(self) -> None:
        await (self.ensure_streams() if self.creates_streams else self.await_streams())

    async def await_streams(self) -> None:
        """Return once every stream of the run exists, waiting (and saying so) while the trainer has not made one."""
        for edge in EDGES:
            name = stream_name(self.run_id, edge)
            await await_run_state(f"stream {name}", functools.partial(self.js.stream_info, name), NotFoundError)

    async def ensure_streams(self) -> None:
        """Create the run's streams, or bring one whose settings changed up to date (an older build's DEAD, say, that
        took only the bare subject): the trainer's part."""
        for edge in EDGES:
            config = self.stream_config(edge)
            try:
                await self.js.add_stream(config)
            except BadRequestError:
                # Exists with other settings (e.g. a changed duplicate window): bring it up to date.
                await self.js.update_stream(config)

    async def decode(self, msg: Msg | StreamMessage, kind: type[M]) -> M:
        """Validate a received message as ``kind`` (fetching a claim-checked body); DecodeError says why it is bad."""
        limit = self.cfg.nats.max_message_bytes
        if len(msg.data) > limit:
            raise DecodeError(f"message of {len(msg.data)} bytes exceeds nats.max_message_bytes={limit}")
        if is_claim_checked(msg.headers):
            claim = decode(msg.data, ClaimCheck)
            check_claim(claim, self.run_id, self.cfg.nats.max_claim_bytes)
            return decode(await read_claimed(self.claims, claim), kind)
        return decode(msg.data, kind)

    def claim_key(self, msg: Msg | StreamMessage) -> str | None:
        """The object-store key of a claim-checked message's body; None for an ordinary message or a bad key."""
        return claimed_key(msg.data, self.run_id) if is_claim_checked(msg.headers) else None

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
            data = encode(await store_claimed(self.claims, self.run_id, edge, msg_id, data))
            headers[H_CLAIM] = "1"
        return await self.js.publish(subject(self.run_id, edge), data, headers=headers, timeout=10)

    @functools.cached_property
    def claims(self) -> ObjectStore:
        return open_store(self.cfg.checkpoint_url, self.cfg.checkpoint)

    async def dead_letter(self, msg: Msg | StreamMessage, reason: str, edge: str, cause: str = "undecodable") -> None:
        """Copy ``msg`` to DEAD, on this role's own subject, with why and where from (``dead_letters.letter_headers``);
        the caller terminates it upstream.

        Broker failures propagate (NatsError, TimeoutError): a stage retries them as an outage
        (``Stage._on_broker``), never as the message's fault. ``cause`` is the reason's class for metrics
        (a ``settle.DeadCause`` value): the free-text reason would give every message its own time series.
        """
        sequence = msg.sequence if isinstance(msg, StreamMessage) else msg.metadata.sequence.stream
        headers = inject_trace(
            {
                **letter_headers(msg.headers, reason, stream_name(self.run_id, edge), sequence, self.service),
                "Nats-Msg-Id": dead_letter_id(edge, sequence),
            }
        )
        await self.js.publish(dead_subject(self.run_id, self.service), msg.data, headers=headers, timeout=10)
        record_dead_letter(self.service, edge, cause)
        log_event(log, Event.DEAD_LETTER, level=logging.WARNING, edge=edge, seq=sequence, reason=reason[:300])

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
        stream, durable, wanted = stream_name(self.run_id, edge), WORK_QUEUES[edge], self.consumer_config(edge)
        try:
            info = await self.js.consumer_info(stream, durable)
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
                stream, durable, {name: (_plain(old), _plain(new)) for name, (old, new) in fixed.items()}
            )
        try:
            updated = await self.js.add_consumer(stream, wanted)  # same durable name: the server updates it
        except APIError as error:
            plain = {name: (_plain(old), _plain(new)) for name, (old, new) in differences.items()}
            raise ConsumerSettingsConflict(stream, durable, plain, str(error.description)) from error
        log_event(
            log,
            Event.CONSUMER_UPDATED,
            stream=stream,
            consumer=wanted.durable_name,
            changes={name: [_plain(old), _plain(new)] for name, (old, new) in differences.items()},
        )
        return updated

    async def work_queue(self, edge: str) -> JetStreamContext.PullSubscription:
        """The durable pull consumer of ``edge``, shared by every replica of its consuming role."""
        await self.ensure_consumer(edge)
        self._work_queues.add(edge)
        return await self.js.pull_subscribe_bind(consumer=WORK_QUEUES[edge], stream=stream_name(self.run_id, edge))

    async def groups_queued(self, incarnation: str) -> set[str] | None:
        """The groups of ``incarnation`` a stage may still deliver from its work queue (work_queues.groups_queued)."""
        return await groups_queued(self.js, self.run_id, self.cfg.nats, incarnation)

    def read_from(self, edge: str, start_seq: int) -> StreamReader:
        """A reader of ``edge`` in stream order from sequence ``start_seq`` on."""
        return StreamReader(self, edge, start_seq)


def _plain(value: object) -> object:
    return value.value if isinstance(value, Enum) else value


def _same_setting(old: object, new: object) -> bool:
    old, new = _plain(old), _plain(new)
    if isinstance(old, float) or isinstance(new, float):  # durations come back from nanoseconds
        return isinstance(old, int | float) and isinstance(new, int | float) and abs(float(old) - float(new)) < 1e-6
    return old == new
