"""What a dead letter carries: the message's own body, why it died and where it came from, in headers.

The group id, claim check and incarnation headers travel with it, so an operator (``rlpipe dead-letters``) and the
trainer can trace a letter back to its group, read its claim-checked body and settle only their own incarnation's.
"""

from __future__ import annotations

from services.common.config import hide_url_secrets
from services.common.transport.streams import (
    H_CLAIM,
    H_GROUP,
    H_INCARNATION,
    H_REASON,
    H_SEQ,
    H_SERVICE,
    H_STREAM,
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
