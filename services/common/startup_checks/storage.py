"""The checkpoint store (and its mirror) takes a write, a read and a delete.

A failure says whether the store refuses this configuration or is only out of reach.
"""

from __future__ import annotations

import errno
import os
import ssl
import threading
import uuid
from collections.abc import Callable
from typing import TypeGuard

from services.common.config import CheckpointConfig, RunConfig
from services.common.startup_checks.rows import CheckResult, shorten

# An S3 probe is four requests (bucket, put, get, delete); a dead endpoint must not stall start-up.
STORAGE_TIMEOUT_S = 5.0


def _with_deadline(work: Callable[[], None], timeout_s: float) -> None:
    """``work()`` in a daemon thread, given up after ``timeout_s``.

    A hung socket cannot be cancelled, only abandoned.
    """
    errors: list[Exception] = []

    def target() -> None:
        try:
            work()
        except Exception as error:  # raised again in the caller's thread
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True, name="doctor-probe")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g}s")
    if errors:
        raise errors[0]


def check_storage(url: str, checkpoint: CheckpointConfig, name: str = "storage", resume: bool = False) -> CheckResult:
    """Write, read back and delete a probe object under a prefix of its own.

    A store that refuses this configuration (``store_refusal``: credentials, a policy, TLS, a path that cannot hold
    a store) fails, naming what to fix. One that is only out of reach fails a fresh start (an endpoint that never
    answered is most likely wrong) but only warns a ``resume``: a store that held the run is down for now, and the
    resume waits for it (``checkpoint.resume_wait_s``, ``resume_waiting`` events) rather than refusing to start,
    which would end the run where an outage should only hold it."""
    from services.common.transport.storage import open_store

    prefix = f".rlpipe-doctor-{uuid.uuid4().hex}/"
    payload = os.urandom(64)
    step = "open"

    def probe() -> None:
        nonlocal step
        store = open_store(url, checkpoint)
        step = "write"
        store.put(prefix + "probe", payload)
        step = "read"
        if store.get(prefix + "probe") != payload:
            raise OSError("read back other bytes than were written")
        step = "delete"
        store.delete_prefix(prefix)
        if store.list(prefix):
            raise OSError("the probe is still listed after delete")

    try:
        _with_deadline(probe, STORAGE_TIMEOUT_S)
    except Exception as error:  # file systems, S3 and the network fail in many types
        failed = f"{url}: {step} failed: {shorten(error)}"
        refused = store_refusal(error, url)
        if refused:
            return CheckResult(name, "fail", f"{failed}; {refused}")
        if resume:
            return CheckResult(
                name,
                "warn",
                f"{failed}; out of reach, not refusing: the resume waits for it (checkpoint.resume_wait_s)",
            )
        return CheckResult(name, "fail", f"{failed}; never reached at a fresh start: check {_where(url)}")
    return CheckResult(name, "ok", f"{url}: write, read and delete work")


# S3 error codes that refuse the caller rather than say the store is down.
S3_REFUSING_CODES = frozenset(
    {"AccessDenied", "AllAccessDisabled", "ExpiredToken", "InvalidAccessKeyId", "InvalidToken", "SignatureDoesNotMatch"}
)

# File-system errors of a store that is away for now (a network mount that went stale, a device error), not one
# whose path cannot hold a store.
OUTAGE_ERRNOS = frozenset(
    {errno.EIO, errno.ESTALE, errno.ENOTCONN, errno.ETIMEDOUT, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETUNREACH}
)


def _where(url: str) -> str:
    return "checkpoint.s3_endpoint and the bucket" if url.startswith("s3://") else f"that {url} is mounted"


def store_refusal(error: BaseException, url: str) -> str:
    """What to fix when ``error`` (or what caused it) is the store refusing this configuration; "" when it is an
    outage (no connection, no answer in time, a 5xx, a name that does not resolve now, a stale mount), which waiting
    may end. A name that does not resolve counts as an outage: compose's DNS forgets a stopped container's name."""
    seen: BaseException | None = error
    for _ in range(8):  # the SDK's retry error, its reason, the socket's error
        if seen is None:
            return ""
        code = getattr(seen, "code", None)
        status = getattr(getattr(seen, "response", None), "status", None) or getattr(seen, "status_code", None)
        if (isinstance(code, str) and code in S3_REFUSING_CODES) or status in (401, 403):
            return (
                "the store refuses these credentials: check RLPIPE_S3_ACCESS_KEY and RLPIPE_S3_SECRET_KEY, and the "
                f"bucket's policy for them ({code or status})"
            )
        if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):  # those two: busy, for now
            return f"the endpoint answers {status}: is checkpoint.s3_endpoint an S3 endpoint?"
        if isinstance(seen, ssl.SSLError):
            return "TLS with the endpoint failed: check checkpoint.s3_secure and the endpoint's certificate"
        if url.startswith("file://") and _path_refused(seen):
            name = errno.errorcode.get(seen.errno or 0, str(seen.errno))
            return f"checkpoint.store_url cannot hold a store here ({name}): fix the folder or its permissions"
        if isinstance(seen, ValueError):
            return f"the store's configuration is refused: {shorten(seen)}"
        reason = getattr(seen, "reason", None)
        seen = reason if isinstance(reason, BaseException) else seen.__cause__ or seen.__context__
    return ""


def _path_refused(error: BaseException) -> TypeGuard[OSError]:
    """A file-system error that says the path cannot hold a store (permissions, a read-only file system, a file in
    the way), not that the store behind it is away for now."""
    if not isinstance(error, OSError) or isinstance(error, (TimeoutError, ConnectionError)):
        return False
    return error.errno is not None and error.errno not in OUTAGE_ERRNOS


def storage_rows(cfg: RunConfig, resume: bool = False) -> list[CheckResult]:
    rows = [check_storage(cfg.checkpoint_url, cfg.checkpoint, resume=resume)]
    if cfg.checkpoint.mirror_url:
        rows.append(check_storage(cfg.checkpoint.mirror_url, cfg.checkpoint, "storage mirror", resume=resume))
    return rows
