"""Claim checks: a body too large for a message is stored in the object store and the message carries its key.

A claim comes from a message and so is trusted with nothing: its key must lie under the run's claim prefix and its
size within ``nats.max_claim_bytes`` (else ``DecodeError``, the message's fault), and the stored body must match its
size and hash. A store that does not answer is ``StoreUnavailable``: the message is fine, the stage holds it. One
that refuses us (wrong or expired credentials, a policy that denies the call, TLS, DNS: ``store_refusal``) is
``StoreRefused``, held the same way but alerted at once (services/common/transport/outage.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import ssl

from services.common.transport.breaker import DependencyRefused, DependencyUnavailable
from services.common.transport.claim_lifecycle import body_tags
from services.common.transport.messages import ClaimCheck, DecodeError, decode
from services.common.transport.storage import ObjectStore
from services.common.transport.streams import H_CLAIM


class StoreUnavailable(DependencyUnavailable):
    """The object store holding a claim-checked body did not answer: the message is fine, try it again later."""


class StoreRefused(DependencyRefused, StoreUnavailable):
    """The object store refuses us (``kind`` says how): the message is fine, and waiting will not help."""


# An S3 error code that refuses the caller rather than saying the store is down.
REFUSING_CODES = frozenset(
    {"AccessDenied", "AllAccessDisabled", "ExpiredToken", "InvalidAccessKeyId", "InvalidToken", "SignatureDoesNotMatch"}
)


def store_refusal(error: BaseException) -> str:
    """How the store refused us, found in ``error`` or what caused it: ``s3_<code>``, ``http_401``/``http_403``,
    ``tls``, ``dns``; "" for an outage (unreachable, timed out, a 5xx). The SDKs' errors name codes, not keys."""
    seen: BaseException | None = error
    for _ in range(6):  # an SDK's retry error, its reason, the socket's error
        if seen is None:
            return ""
        code = getattr(seen, "code", None)
        if isinstance(code, str) and code in REFUSING_CODES:
            return f"s3_{code}"
        status = getattr(seen, "status_code", None) or getattr(getattr(seen, "response", None), "status", None)
        if status in (401, 403):
            return f"http_{status}"
        if isinstance(seen, ssl.SSLError):
            return "tls"
        if isinstance(seen, socket.gaierror):
            return "dns"
        reason = getattr(seen, "reason", None)
        seen = reason if isinstance(reason, BaseException) else seen.__cause__ or seen.__context__
    return ""


def unavailable(reason: str, error: BaseException) -> StoreUnavailable:
    """The store's failure as the stage holds it: refused when ``store_refusal`` says so, an outage else."""
    kind = store_refusal(error)
    return StoreRefused(kind, reason) if kind else StoreUnavailable(reason)


class ClaimMissing(DecodeError):
    """The claim-checked body is not in the store: the message's fault, unless a twin delivery consumed it and
    deleted the body (``claim_lifecycle.missing_body_is_stale``)."""


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


def is_claim_checked(headers: dict[str, str] | None) -> bool:
    """Whether a message with these headers carries a ClaimCheck instead of its body."""
    return bool(headers and headers.get(H_CLAIM))


def claimed_key(data: bytes, run_id: str) -> str | None:
    """The key a claim-checked message's ``data`` points at; None for a claim that does not decode or a bad key."""
    try:
        claim = decode(data, ClaimCheck)
    except DecodeError:
        return None
    return claim.key if claim_key_fault(claim.key, run_id) is None else None


async def read_claimed(store: ObjectStore, claim: ClaimCheck) -> bytes:
    """The body ``claim`` (already checked with ``check_claim``) points at, matched against its size and hash.

    DecodeError when it is missing or does not match (the message's fault), StoreUnavailable when the store fails.
    """
    try:
        # Off the event loop: a slow store must not stall acks, heartbeats and admin calls. One byte past
        # the declared size is enough to see that a stored body is longer than its claim.
        data = await asyncio.to_thread(lambda: store.get(claim.key, limit=claim.size + 1))
    except FileNotFoundError as error:
        raise ClaimMissing(f"claim-checked body {claim.key} is missing: {error}") from None
    except Exception as error:  # the store's many failure types: unreachable, refused, timed out
        raise unavailable(f"claim-checked body {claim.key} could not be read: {error!r}"[:500], error) from error
    if len(data) != claim.size or hashlib.sha256(data).hexdigest() != claim.sha256:
        raise DecodeError(f"claim-checked body {claim.key} does not match its size and hash")
    return data


async def store_claimed(store: ObjectStore, run_id: str, edge: str, msg_id: str, data: bytes) -> ClaimCheck:
    """Store ``data`` as a claim-checked body of a message to ``edge``; StoreUnavailable when the store fails."""
    sha256 = hashlib.sha256(data).hexdigest()
    # Keyed by content too: a redelivered compute's body (a new sample) must not overwrite the body of
    # the message the stream kept, whose repeat the duplicate window drops.
    key = f"{claim_prefix(run_id)}{edge}/{msg_id}-{sha256[:16]}"
    try:
        await asyncio.to_thread(lambda: store.put(key, data, tags=body_tags(edge)))
    except Exception as error:  # S3 errors, refused or timed-out connections: the store, not the message
        raise unavailable(f"claim-checked body {key} could not be stored: {error!r}"[:500], error) from error
    return ClaimCheck(key=key, size=len(data), sha256=sha256)
