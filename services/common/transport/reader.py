"""Reading a limits-retention stream (EXPERIENCE, DEAD) in order by sequence, never past lost messages."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.transport.streams import (
    DEAD,
    STREAM_NOT_FOUND,
    BrokerStateLost,
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
                log_event(log, Event.BUS_UNAVAILABLE, level=logging.WARNING, error=repr(error)[:300])
            if raw is not None:
                if raw.seq != self.next_seq and not self.holes_allowed:  # the messages between are lost
                    raise StreamGap(self.stream, self.next_seq, raw.seq)
                self.next_seq = raw.seq + 1
                return StreamMessage(raw.seq, raw.data or b"", dict(raw.headers) if raw.headers else None)
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(0.05)
