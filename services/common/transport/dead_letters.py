"""What a dead letter carries: the message's own body, why it died and where it came from, in headers.

The group id, claim check and incarnation headers travel with it, so an operator (``rlpipe dead-letters``) and the
trainer can trace a letter back to its group, read its claim-checked body and settle only their own incarnation's.

Headers are the writer's word, and any stage may write to DEAD: what a letter is trusted for follows its subject,
which the broker lets only one role publish to (``streams.dead_subject``, ``nats_auth``). ``forged`` says why a DEAD
message is not what it claims: a letter whose source stream is not the one its role reads, a re-inject record or note
off the operator's subject, or a letter on the operator's. A message on the bare DEAD subject (an older build's) is
taken at its headers' word, as that build took it.
"""

from __future__ import annotations

from services.common.config import hide_url_secrets
from services.common.transport.streams import (
    H_CLAIM,
    H_GROUP,
    H_INCARNATION,
    H_REASON,
    H_REINJECT_SENT,
    H_REINJECTED,
    H_SEQ,
    H_SERVICE,
    H_STREAM,
    OPERATOR,
    READS,
    dead_role,
    stream_name,
)

REASON_CHARS = 1000  # a header is one line: longer reasons (a whole traceback) are cut
CARRIED_HEADERS = (H_GROUP, H_CLAIM, H_INCARNATION)


def dead_letter_id(edge: str, sequence: int) -> str:
    """The letter's Nats-Msg-Id: a stage that dead-letters the same message twice (a retried publish) sends one."""
    return f"{edge}.{sequence}.dead"


def letter_headers(
    source: dict[str, str] | None, reason: str, stream: str, sequence: int, service: str
) -> dict[str, str]:
    """The headers of the dead letter of message ``sequence`` of ``stream`` (whose headers were ``source``)."""
    headers = {
        H_REASON: hide_url_secrets(reason)[:REASON_CHARS].replace("\r", " ").replace("\n", " "),
        H_STREAM: stream,
        H_SEQ: str(sequence),
        H_SERVICE: service,
    }
    for carried in CARRIED_HEADERS:
        if source and carried in source:
            headers[carried] = source[carried]
    return headers


def forged(run_id: str, subject: str, headers: dict[str, str] | None) -> str | None:
    """Why the DEAD message on ``subject`` with ``headers`` is forged, or None when its subject vouches for it."""
    role = dead_role(run_id, subject)
    if role is None:  # an older build's bare subject
        return None
    headers = headers or {}
    if H_REINJECTED in headers or H_REINJECT_SENT in headers:
        return None if role == OPERATOR else f"a re-inject record on {subject}: only the operator's subject has them"
    if role not in READS:  # the operator's subject (records and notes only), or no role's
        return f"a dead letter on {subject}, where no stage writes its letters"
    source = stream_name(run_id, READS[role])
    if headers.get(H_STREAM) != source:
        return f"a dead letter on {subject} naming stream {headers.get(H_STREAM)!r}: the {role} reads only {source}"
    return None
