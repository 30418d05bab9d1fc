"""Reading a limits-retention stream (EXPERIENCE, DEAD) in order by sequence, never past lost messages."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from datetime import datetime
from typing import TYPE_CHECKING

from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.transport.streams import (
    ANY_SUBJECT,
    DEAD,
    StreamGap,
    StreamMessage,
    stream_name,
    subject,
)

if TYPE_CHECKING:
    from services.common.transport.bus import Bus

log = logging.getLogger(__name__)

# How often an idle StreamReader re-checks that its stream is still the one it has been reading.
READER_VERIFY_S = 2.0
# Messages one direct get reads ahead (a trainer's batch of groups in one round trip), and the bytes it may bring.
READ_AHEAD = 64
READ_AHEAD_BYTES = 16 * 1024 * 1024
REPLY_TIMEOUT_S = 5.0  # the longest a direct get waits for each reply, as nats-py's own requests do
# A batched direct get's replies: a message carries these besides its own headers, which are all a reader keeps;
# a status reply ends the batch (204), says there is nothing (404) or that nothing could answer (503).
# Each reply names the sequence of the one sent before it in the same batch (0 before the first): a reply lost on
# the way (a reconnect mid-batch) shows as a mismatch, a hole in the stream as a jump the broker made itself.
SEQUENCE_HEADER, PREVIOUS_HEADER, SUBJECT_HEADER = "Nats-Sequence", "Nats-Last-Sequence", "Nats-Subject"
DIRECT_GET_HEADERS = frozenset(
    {"Nats-Stream", SUBJECT_HEADER, SEQUENCE_HEADER, "Nats-Time-Stamp", "Nats-Num-Pending", PREVIOUS_HEADER}
)
STATUS_HEADER, DESCRIPTION = "Status", "Description"
END_OF_BATCH, NO_MESSAGE = "204", "404"


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
        # Every subject of DEAD (each role writes to its own, an older build to the bare one); wildcards in a direct
        # get's next_by_subj need nats-server 2.10, below the 2.11 rlpipe asks for (nats_connect.MIN_BROKER_VERSION).
        self.subject = ANY_SUBJECT if edge == DEAD else subject(bus.run_id, edge)
        self._replies: Subscription | None = None  # where the broker answers this reader's direct gets
        self._inbox = ""
        self._requests = 0
        self.seek(start_seq)

    def seek(self, start_seq: int) -> None:
        """Read from ``start_seq`` on, as a new reader would: what was read ahead is dropped and the stream is
        checked again before the next read (a restore or a rollback may follow a stream re-created)."""
        self.next_seq = start_seq
        self.created: datetime | None = None  # the stream's creation time when this reader first checked it
        self._verified_reconnects: int | None = None  # bus.reconnects at the last check; None: never checked
        self._verified_at = 0.0
        self._ahead: deque[StreamMessage] = deque()  # read from the broker, not yet handed out

    @property
    def buffered(self) -> int:
        """Messages read ahead and not handed out yet: as many ``next`` calls that need no broker."""
        return len(self._ahead)

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
            if not self._ahead:
                try:
                    if self._verified_reconnects != self.bus.reconnects:
                        await self.verify()
                    self._ahead = await self._read_ahead()
                    # Nothing at or after next_seq yet. A stream re-created and refilled past next_seq would hand
                    # out other messages under the sequences expected, so the idle reader re-checks it now and then.
                    if not self._ahead and loop.time() - self._verified_at >= READER_VERIFY_S:
                        with contextlib.suppress(NatsError, TimeoutError):
                            await self.verify()
                except (NatsError, TimeoutError) as error:
                    log_event(log, Event.BUS_UNAVAILABLE, level=logging.WARNING, error=repr(error)[:300])
            if self._ahead:
                message = self._ahead.popleft()
                self.next_seq = message.sequence + 1
                return message
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(0.05)

    async def _read_ahead(self) -> deque[StreamMessage]:
        """The messages from ``next_seq`` on, up to ``READ_AHEAD`` of them (or ``READ_AHEAD_BYTES``), in one batched
        direct get: the broker sends each to this request's reply subject, then an end-of-batch status (204), or 404
        when there is none yet. Checked for holes as they come: the messages before a hole are handed out first,
        the hole raises on the next read. A batch cut short (the connection lost, a reply lost with it) keeps the
        messages that came before the loss; the next read asks again from there. A reconnect while it was read
        has the stream checked before the batch is handed out, as the first read after a reconnect would."""
        nc = self.bus.nc
        connections = self.bus.connections
        if self._replies is None:  # one subscription for every request of this reader, each on its own subject
            self._inbox = nc.new_inbox()
            self._replies = await nc.subscribe(f"{self._inbox}.*")
        self._requests += 1
        reply_to = f"{self._inbox}.{self._requests}"
        request = {"seq": self.next_seq, "next_by_subj": self.subject, "batch": READ_AHEAD}
        request["max_bytes"] = READ_AHEAD_BYTES
        await nc.publish(f"$JS.API.DIRECT.GET.{self.stream}", json.dumps(request).encode(), reply=reply_to)
        ahead = await self._replies_to(self._replies, reply_to)
        if ahead and self.bus.connections != connections:
            await self.verify()
        return ahead

    async def _replies_to(self, replies: Subscription, reply_to: str) -> deque[StreamMessage]:
        ahead: deque[StreamMessage] = deque()
        expected, previous = self.next_seq, 0
        while True:
            try:
                reply = await replies.next_msg(timeout=REPLY_TIMEOUT_S)
            except TimeoutError:
                if ahead:
                    return ahead
                raise
            if reply.subject != reply_to:  # a late answer to an earlier request that timed out
                continue
            headers = reply.headers or {}
            status = headers.get(STATUS_HEADER)
            if status in (END_OF_BATCH, NO_MESSAGE):
                return ahead
            if status is not None:  # 503: no stream answers (gone, or one that allows no direct gets)
                await self.verify()  # BrokerStateLost if it is gone
                raise NatsError(f"direct get from {self.stream} answered {status} {headers.get(DESCRIPTION)}")
            if int(headers[PREVIOUS_HEADER]) != previous:  # the broker sent one in between that never came
                if ahead:
                    return ahead
                raise NatsError(f"a direct get reply from {self.stream} was lost on the way; asking again")
            sequence = previous = int(headers[SEQUENCE_HEADER])
            if sequence != expected and not self.holes_allowed:  # the broker skipped them: they are gone
                if ahead:
                    return ahead
                raise StreamGap(self.stream, expected, sequence)
            expected = sequence + 1
            kept = {k: v for k, v in headers.items() if k not in DIRECT_GET_HEADERS}
            ahead.append(StreamMessage(sequence, reply.data or b"", kept or None, headers.get(SUBJECT_HEADER, "")))
