"""How a stage settles one message: the decision alone, from what happened to it and its delivery count.

No broker here: ``Stage`` (``services.common.transport.stage``) asks ``settle`` (and, before it decodes a message,
``unsettled_letter``) and carries the answer out: ``Ack`` the input once its output is published, ``Nak`` it with a
delay (a delivery spent, redelivered after the delay), or send it to DEAD with the reason and ``term`` it
(``DeadLetter``). The rules:

- a message that cannot be decoded or validated is the message's fault and is dead at once (``undecodable``);
- a compute that raises (anything but ``DependencyUnavailable``) is retried with backoff, ``2**delivered`` seconds up
  to ``NAK_BACKOFF_CAP_S``, until the delivery that reaches ``max_deliver``, which goes to DEAD (``max_deliver``,
  with the last error); a compute abandoned past ``nats.max_work_s`` the same way, with cause ``timeout``;
- a message delivered more often than ``max_deliver`` (the consumer allows one more) never reached an outcome on any
  of its deliveries: the service crashed or hung on it, and it goes to DEAD before it is tried again.

A dependency outage is not in this table because it settles nothing: the stage holds every message it has (telling
JetStream they are in progress) and retries the failed step behind its breaker, so no delivery is spent
(``Stage._available``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

NAK_BACKOFF_CAP_S = 30.0  # the longest a failed message waits before its next delivery


class Outcome(Enum):
    """What happened to one message on this delivery."""

    UNDECODABLE = "undecodable"  # decoding or validating it failed: its own fault
    COMPUTED = "computed"  # its output was published downstream
    FAILED = "failed"  # the compute raised for it: its input's fault, or so it is taken after max_deliver tries
    TIMED_OUT = "timed_out"  # the compute ran past nats.max_work_s and was abandoned


class DeadCause(Enum):
    """A dead letter's reason as a class, for metrics: the free-text reason would give every letter its own series."""

    UNDECODABLE = "undecodable"
    MAX_DELIVER = "max_deliver"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class Ack:
    """Done: acknowledge the input."""

    label = "ok"


@dataclass(frozen=True)
class Nak:
    """Hand it back for another delivery after ``delay_s`` seconds; this delivery is spent."""

    delay_s: float
    label = "retry"


@dataclass(frozen=True)
class DeadLetter:
    """Copy it to DEAD with ``reason``, then terminate it upstream."""

    cause: DeadCause
    reason: str
    label = "dead"


Decision = Ack | Nak | DeadLetter


def nak_delay_s(delivered: int) -> float:
    """Seconds before the next delivery of a message that failed its ``delivered``-th."""
    return min(2.0**delivered, NAK_BACKOFF_CAP_S)


def unsettled_letter(delivered: int, max_deliver: int, service: str) -> DeadLetter | None:
    """A freshly delivered message's dead letter if its earlier deliveries used up ``max_deliver`` without any of them
    reaching an outcome (``service`` crashed or hung on it); None while it may still be tried."""
    if delivered <= max_deliver:
        return None
    reason = f"delivered {delivered} times without an outcome: a {service} crashed or hung on it"
    return DeadLetter(DeadCause.MAX_DELIVER, reason)


def settle(outcome: Outcome, delivered: int, max_deliver: int, error: BaseException | None = None) -> Decision:
    """What to do with a message whose ``delivered``-th delivery (JetStream's count, this one included) ended in
    ``outcome``; ``error`` is what the decode or compute raised, for the dead letter's reason."""
    if outcome is Outcome.COMPUTED:
        return Ack()
    if outcome is Outcome.UNDECODABLE:
        return DeadLetter(DeadCause.UNDECODABLE, str(error))
    if delivered < max_deliver:
        return Nak(nak_delay_s(delivered))
    if outcome is Outcome.TIMED_OUT:
        return DeadLetter(DeadCause.TIMEOUT, f"timeout: {error} on each of {delivered} deliveries")
    return DeadLetter(DeadCause.MAX_DELIVER, f"failed {delivered} times, last: {error!r}")
