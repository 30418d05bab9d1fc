"""When a work queue's claim-checked body may be deleted, decided in pure code from what a stage saw of its delivery.

A body in ``<run>/claims/{prompts,rollouts,scored}/`` is read by the one stage that consumes its work queue. Once
that stage has acked the message, the broker removed it from the stream (work-queue retention), and the body is
garbage unless someone else can still read it. Three readers could:

- another delivery of the same message. JetStream redelivers only after ``nats.ack_wait_s`` without an ack or an
  ``in_progress``; a stage beats every ``heartbeat_s`` (below ``ack_wait_s``), so a delivery whose holder never went
  half an ``ack_wait_s`` without a beat (``held_throughout``) had no twin. A holder that did (its event loop stalled,
  the process paused) leaves the body to the store's lifecycle rule, and if it finds its own body gone it hands the
  message back rather than dead-letter it (``missing_body_is_stale``): a twin consumed it, or the next delivery,
  held throughout, sends it to DEAD.
- the DEAD stream. A letter carries the claim (``dead_letters.CARRIED_HEADERS``) for ``rlpipe dead-letters`` and
  ``--reinject``. A stage acks only after publishing downstream, never after dead-lettering (it terms then); and a
  message an earlier delivery dead-lettered (a crash before its term) is dead-lettered again by the next, since
  the reasons are deterministic (undecodable) or counted (deliveries), so an acked message has no letter.
- a re-injected copy's letter: ``rlpipe dead-letters --reinject`` sends the letter's own claim back and leaves the
  letter in DEAD, so a re-inject's body (its ``Nats-Msg-Id`` starts with ``REINJECT_ID_PREFIX``) is kept.

EXPERIENCE is not a work queue: the trainer re-reads it after a resume or a rollback, and deletes its bodies with
the purge (services/trainer/checkpointing/retention.py). Work-queue bodies are tagged ``TRANSIENT_TAG`` when stored,
so the
bucket's lifecycle rule (deploy/minio/init.sh, docs/operations.md) expires the ones left behind (a stage killed
between ack and delete, a holder that lapsed, a letter aged out of DEAD, a redelivered compute's body whose publish
the duplicate window dropped) without touching EXPERIENCE's or the checkpoints.
"""

from __future__ import annotations

from services.common.transport.lifecycle_tags import TRANSIENT_TAG
from services.common.transport.streams import WORK_QUEUES

REINJECT_ID_PREFIX = "reinjected."  # the Nats-Msg-Id of a message `rlpipe dead-letters --reinject` sent back


def body_tags(edge: str) -> dict[str, str]:
    """Object tags for a claim-checked body of a message to ``edge``: work queues' bodies are the lifecycle rule's."""
    return dict([TRANSIENT_TAG]) if edge in WORK_QUEUES else {}


def held_throughout(longest_gap_s: float, ack_wait_s: float) -> bool:
    """Whether a delivery held with beats never more than ``longest_gap_s`` apart (from fetch to ack) can have had a
    redelivered twin: not below half of ``ack_wait_s``, the margin for the broker having delivered before our fetch
    returned and for a beat's trip."""
    return longest_gap_s < ack_wait_s / 2


def is_reinjected(headers: dict[str, str] | None) -> bool:
    return bool(headers) and headers.get("Nats-Msg-Id", "").startswith(REINJECT_ID_PREFIX)


def deletable_after_ack(headers: dict[str, str] | None, longest_gap_s: float, ack_wait_s: float) -> bool:
    """Whether the claim-checked body of a work-queue message this delivery acked may be deleted now (see the module
    docstring for why each condition makes it safe)."""
    return not is_reinjected(headers) and held_throughout(longest_gap_s, ack_wait_s)


def missing_body_is_stale(longest_gap_s: float, ack_wait_s: float) -> bool:
    """Whether a claim body found missing may have been deleted by a twin delivery that consumed the message: only
    when this one lapsed (not ``held_throughout``). Then it is handed back, not dead-lettered."""
    return not held_throughout(longest_gap_s, ack_wait_s)
