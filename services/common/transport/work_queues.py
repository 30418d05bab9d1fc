"""Which groups the stages' work queues (PROMPTS, ROLLOUTS, SCORED) still hold for delivery.

A stage acknowledges its input only after publishing its output, so at every moment a group in flight has a
message in one of these queues or in EXPERIENCE. A message in a queue may still be delivered until its deliveries
are spent: the consumer allows ``max_deliver + 1`` (the last one dead-letters a message no delivery settled), each
taking at most ``max_work_s`` of compute (held in progress by heartbeats), or ``ack_wait_s`` when its replica died,
and then a nak's backoff. A message the queue's consumer has not delivered yet waits for a replica however long;
one delivered and still there past that horizon after its publication is one no stage will settle: its group is
lost. The trainer asks this before writing a group off (services/trainer/intake/reader.py), so a long but
healthy compute is never taken for a loss.
"""

from __future__ import annotations

import time
from typing import Any

from nats.js.errors import NotFoundError

from services.common.config import NatsConfig
from services.common.transport.settle import NAK_BACKOFF_CAP_S
from services.common.transport.streams import H_GROUP, H_INCARNATION, WORK_QUEUES, stream_name, subject

QUEUED_SCAN_LIMIT = 4096  # messages read at most in one look; more than this in the queues is a backlog


def redelivery_horizon_s(nats: NatsConfig) -> float:
    """Seconds after its publication within which a work-queue message may still be delivered and settled:
    ``(max_deliver + 1) x (max(max_work_s, ack_wait_s) + NAK_BACKOFF_CAP_S)``."""
    return (nats.max_deliver + 1) * (max(nats.max_work_s, nats.ack_wait_s) + NAK_BACKOFF_CAP_S)


async def groups_queued(
    js: Any,
    run_id: str,
    nats: NatsConfig,
    incarnation: str,
    limit: int = QUEUED_SCAN_LIMIT,
    now: float | None = None,
) -> set[str] | None:
    """The groups of ``incarnation`` with a message in a work queue that is not delivered yet or was published within
    the redelivery horizon; None when the queues hold more than ``limit`` messages (a backlog: then nothing can be
    told lost). ``now``: the wall time to judge at (the present by default)."""
    published_after = (time.time() if now is None else now) - redelivery_horizon_s(nats)
    queued: set[str] = set()
    read = 0
    for edge in WORK_QUEUES:
        stream = stream_name(run_id, edge)
        state = (await js.stream_info(stream)).state
        read += state.messages
        if read > limit:
            return None
        undelivered_from = await first_undelivered(js, stream, WORK_QUEUES[edge])
        seq = state.first_seq
        while state.messages and seq <= state.last_seq:
            try:  # acknowledged messages leave holes: the next one on the subject at or after seq
                message = await js.get_msg(stream, seq, subject=subject(run_id, edge), next=True)
            except NotFoundError:
                break
            headers = message.headers or {}
            published = message.time.timestamp() if message.time is not None else published_after
            fresh = message.seq >= undelivered_from or published >= published_after
            # A message without an incarnation is any incarnation's, as the trainer reads it (Intake._ours).
            if fresh and headers.get(H_INCARNATION, "") in ("", incarnation) and headers.get(H_GROUP):
                queued.add(headers[H_GROUP])
            seq = message.seq + 1
    return queued


async def first_undelivered(js: Any, stream: str, consumer: str) -> int:
    """The first stream sequence ``consumer`` has not delivered yet (1 before the consumer exists)."""
    try:
        info = await js.consumer_info(stream, consumer)
    except NotFoundError:
        return 1
    return (info.delivered.stream_seq if info.delivered is not None else 0) + 1
