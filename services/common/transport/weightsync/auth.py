"""Who may talk WeightSync: every call to the trainer's port, and to a relaying rollout's, carries the run's token.

The token (RLPIPE_WEIGHTSYNC_TOKEN) is given to the trainer and the rollouts only: a reward or reference replica, or
anything else on the network, can neither pull the policy's weights nor join the relay tree with an address of its
choosing (a relay address arrives on ``WatchVersions``, so it is taken from authenticated rollouts alone). Health and
reflection stay open for probes. TLS, when ``weight_sync.tls_*`` is set, is the transport's business
(services/common/transport/weight_sync_tls.py); the token is checked either way.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.common.config import WeightSyncCredentials
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.refusal import StartRefused
from services.common.transport.weightsync.wire import SERVICE_NAME

log = logging.getLogger(__name__)

REFUSAL = "missing or wrong weight-sync token (metadata authorization: Bearer <RLPIPE_WEIGHTSYNC_TOKEN>)"


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """What a client sends with each call; nothing when the run has no token."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class WeightSyncToken(grpc.aio.ServerInterceptor):
    """Refuses every WeightSync call without ``authorization: Bearer <token>`` with UNAUTHENTICATED, before the
    servicer sees it: no version, no chunk and no relay address get through."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("a weight-sync token must not be empty")
        self._expected = f"Bearer {token}".encode()

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
            yield  # pragma: no cover - abort raises; the yield makes this a streaming handler

        # The refusal has the refused method's shape, so the client reads a status, not a protocol error.
        self._refuse_unary = grpc.unary_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(refuse_stream)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        if not details.method.startswith(f"/{SERVICE_NAME}/"):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        return self._refuse_stream if handler is not None and handler.response_streaming else self._refuse_unary


def server_interceptors(environment: str | None) -> list[grpc.aio.ServerInterceptor]:
    """The token check for the trainer's WeightSync port. Without a token the port is open: refused in a prod
    ``environment``, a warning elsewhere (``rlpipe run``, compose and the k8s overlays always give one)."""
    token = WeightSyncCredentials().token
    if token:
        return [WeightSyncToken(token)]
    if environment == "prod":
        raise StartRefused("RLPIPE_WEIGHTSYNC_TOKEN is not set: a prod trainer does not serve its weights to anyone")
    log_event(log, Event.WEIGHT_SYNC_OPEN, level=logging.WARNING, reason="RLPIPE_WEIGHTSYNC_TOKEN is not set")
    return []
