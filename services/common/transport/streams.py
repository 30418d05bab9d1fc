"""The run's streams by name: edges, subjects, stream names, the headers a message carries, and the errors that say
the broker lost what a stream held.

PROMPTS, ROLLOUTS and SCORED are work queues, each read by one durable pull consumer that all replicas of the
consuming role share. EXPERIENCE keeps its messages (limits retention) so the trainer can re-read from a sequence
after a crash. DEAD collects what a stage could not handle, with the reason in headers.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPTS, ROLLOUTS, SCORED, EXPERIENCE, DEAD = "prompts", "rollouts", "scored", "experience", "dead"
WORK_QUEUES = {PROMPTS: "rollout", ROLLOUTS: "reward", SCORED: "reference"}  # edge -> consuming role
EDGES = (PROMPTS, ROLLOUTS, SCORED, EXPERIENCE, DEAD)
# The edge each role reads, and so the only stream its dead letters can come from.
READS = {**{role: edge for edge, role in WORK_QUEUES.items()}, "trainer": EXPERIENCE}
ANY_SUBJECT = ">"  # a filter that takes every subject of a stream (reading all of DEAD)
# The DEAD subject of the operator's re-inject records and notes (``rlpipe dead-letters --reinject``).
OPERATOR = "operator"

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
# On the DEAD message written once the copy of a re-inject is on its origin stream: the letter's DEAD sequence. It
# names no group, so the trainer passes over it; it is what tells a re-inject done from one stopped half-way.
H_REINJECT_SENT = "Rlpipe-Reinject-Sent"


def subject(run_id: str, edge: str) -> str:
    return f"rlpipe.{run_id}.{edge}"


def dead_subject(run_id: str, role: str) -> str:
    """The DEAD subject ``role`` writes its dead letters (the operator its re-inject records) to."""
    return f"{subject(run_id, DEAD)}.{role}"


def dead_role(run_id: str, message_subject: str) -> str | None:
    """The role whose DEAD subject ``message_subject`` is; None for the bare DEAD subject, which an older build
    wrote every letter to (any role could, so a letter there says nothing sure about where it came from)."""
    prefix = f"{subject(run_id, DEAD)}."
    return message_subject[len(prefix) :] if message_subject.startswith(prefix) else None


def stream_subjects(run_id: str, edge: str) -> list[str]:
    """The subjects ``edge``'s stream captures: DEAD takes every role's and, for letters an older build wrote,
    the bare one."""
    bare = subject(run_id, edge)
    return [bare, f"{bare}.>"] if edge == DEAD else [bare]


def stream_name(run_id: str, edge: str) -> str:
    return f"RLPIPE_{run_id}_{edge.upper()}"


@dataclass
class StreamMessage:
    """One message read from a stream by sequence (``StreamReader``), not delivered by a consumer."""

    sequence: int
    data: bytes
    headers: dict[str, str] | None
    subject: str = ""  # the subject it was published on (on DEAD, it says which role wrote it)


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
