"""How a process connects to the run's broker: its role's nkey, its reply inbox and the broker's TLS trust.

The identities and permissions themselves are in ``services.common.transport.nats_auth``. The trainer owns the
run's broker state: it alone creates and updates the streams and key-value buckets, and every other
role waits for them (``await_run_state``), whatever order the services start in.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import ServerVersion
from nats.errors import Error as NatsError

from services.common.config import NatsConfig
from services.common.observe.events import Event
from services.common.observe.logs import log_event

RUN_OWNER = "trainer"
STAGE_ROLES = ("rollout", "reward", "reference")
SERVICE_ROLES = (RUN_OWNER, *STAGE_ROLES)
ROLES = (*SERVICE_ROLES, "operator")
# While the run's owner has not created what a role needs, the role looks again after at most WAIT_POLL_S
# and says in its log that it is waiting every WAIT_LOG_S.
WAIT_POLL_S = 2.0
WAIT_LOG_S = 10.0

log = logging.getLogger(__name__)
T = TypeVar("T")


def creates_run_state(role: str) -> bool:
    """Whether ``role`` creates the run's streams and buckets when they are missing: the trainer does; a stage or
    an operator's tool waits for them (its key may only look them up). A name outside ``ROLES`` (a test's client
    of a broker without keys) stands in for the trainer."""
    return role == RUN_OWNER or role not in ROLES


def inbox_prefix(role: str) -> str:
    """Where ``role``'s replies arrive: the broker lets only that role subscribe there."""
    return f"_INBOX_{role}"


def message_limit_refusal(max_message_bytes: int, max_payload: int) -> str | None:
    """Why a service must not run with ``nats.max_message_bytes`` against a broker taking at most ``max_payload``
    bytes per message (None when it fits): the broker would refuse each message in between, so a group just under
    the config's limit would fail its publish for ever instead of being claim-checked or dead-lettered."""
    if max_message_bytes <= max_payload:
        return None
    return (
        f"nats.max_message_bytes is {max_message_bytes} bytes but the broker takes at most {max_payload} "
        f"(its max_payload): set nats.max_message_bytes to {max_payload} or less, or raise max_payload in the "
        "nats-server config"
    )


# Batched direct gets (``StreamReader``) came with 2.11: an older server answers one message a request and never
# ends the batch, so each read would wait out its reply timeout.
MIN_BROKER_VERSION = (2, 11)


def broker_version_refusal(version: ServerVersion) -> str | None:
    """Why a service must not run against this nats-server ``version`` (None when it is recent enough)."""
    wanted = ".".join(map(str, MIN_BROKER_VERSION))
    try:
        if (version.major, version.minor) >= MIN_BROKER_VERSION:
            return None
        found = f"{version.major}.{version.minor}.{version.patch}"
    except ValueError:  # not semantic versioning: no nats-server release
        return f"the broker's version {version!r} cannot be read; rlpipe needs nats-server {wanted} or later"
    return (
        f"the broker is nats-server {found}; rlpipe needs {wanted} or later (its trainer reads streams in batched "
        "direct gets): upgrade the server (deploy/compose.yaml pins the tested image)"
    )


def connect_options(nats_cfg: NatsConfig, role: str) -> dict[str, Any]:
    """``nats.connect`` keywords for ``role`` (a tool that is no service connects as ``operator``)."""
    options: dict[str, Any] = {}
    if nats_cfg.nkey_seed_file is not None:
        options["nkeys_seed"] = str(nats_cfg.nkey_seed_file)
        options["inbox_prefix"] = inbox_prefix(role if role in ROLES else "operator")
    if nats_cfg.tls_ca_file is not None:
        options["tls"] = ssl.create_default_context(cafile=str(nats_cfg.tls_ca_file))
    return options


async def await_run_state(what: str, look_up: Callable[[], Awaitable[T]], missing: type[Exception]) -> T:
    """``look_up()``'s result once ``what`` (a stream or bucket the trainer creates) exists.

    While ``look_up`` raises ``missing`` (not created yet: the trainer is not up, or the broker came back
    without its store and the trainer has not restored it) or the broker does not answer, it looks again
    with backoff, logging ``waiting_for_trainer`` at once and every ``WAIT_LOG_S``: a role waits the
    trainer out, it neither fails (to be restarted in a loop) nor creates the state itself.
    """
    started, delay, logged_at = time.monotonic(), 0.1, None
    while True:
        try:
            found = await look_up()
        except missing:
            reason = "not created yet: the trainer creates it"
        except (NatsError, TimeoutError) as error:
            reason = f"cannot be looked up: {error!r}"[:300]
        else:
            if logged_at is not None:
                log_event(log, Event.TRAINER_STATE_FOUND, what=what, waited_s=round(time.monotonic() - started, 1))
            return found
        now = time.monotonic()
        if logged_at is None or now - logged_at >= WAIT_LOG_S:
            logged_at = now
            log_event(
                log,
                Event.WAITING_FOR_TRAINER,
                level=logging.WARNING,
                what=what,
                reason=reason,
                waited_s=round(now - started, 1),
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, WAIT_POLL_S)
