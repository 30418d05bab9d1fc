"""The ``Admin`` gRPC service the trainer hosts for operators (proto/admin.proto).

Read-only calls answer from the trainer's state at once; calls that change training
(pause, rollback, checkpoint, stop) are queued to the training loop, which runs them
between steps, and answer when they are done. A scale request changes no training: it is stored at once, for the
launcher of a local run to carry out. Every call must carry a bearer token.

Two tokens: the admin token makes every call; the read token, when one is set, makes only the calls
``METHOD_ACCESS`` marks ``Access.READ`` (status, config, config history, the checkpoint list), and any other call
with it is refused with PERMISSION_DENIED naming the call. The admin token comes from RLPIPE_ADMIN_TOKEN (fixed for
the process) or from ``admin.token_file``, the read token from RLPIPE_ADMIN_READ_TOKEN or ``admin.read_token_file``;
each file is re-read whenever it changes: writing a new token there rotates it without a restart, and the old one
is refused from the next call on.

Before the token, the caller's address: a call from outside ``admin.allowed_sources`` is refused with
PERMISSION_DENIED whatever it carries (``SourceAllowlist``).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import yaml

from services.common.config import AdminCredentials, ConfigError, RunConfig, TokenError, read_token_file, redacted_dump
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.pb import admin_pb2, admin_pb2_grpc
from services.common.transport.live_config import parse_value
from services.common.transport.scale import (
    ScaledElsewhere,
    ScaleRefused,
    check_scale,
    configured_replicas,
    read_scale,
    store_scale,
)
from services.trainer.checkpointing.manifest import CatalogEntry
from services.trainer.checkpointing.state import CheckpointCorrupt
from services.trainer.checkpointing.store import AbandonedStep
from services.trainer.control import RunState

if TYPE_CHECKING:
    from services.common.transport.live_config import LiveConfig
    from services.trainer.checkpointing.recovery import Recovery
    from services.trainer.control import Control
    from services.trainer.status import StatusReporter

log = logging.getLogger(__name__)
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
ADMIN_SERVICE = "/rlpipe.v1.Admin/"


class Access(StrEnum):
    """Which token an Admin method needs."""

    READ = "read"  # reads the run's state and changes nothing: the read token or the admin token
    ADMIN = "admin"  # changes the run (or its stored config or scale): the admin token alone


# Every method of proto/admin.proto's Admin service, by what it does; a unit test fails on a method missing here, so a
# new RPC is classified before it ships. A method not listed needs the admin token.
METHOD_ACCESS: dict[str, Access] = {
    "GetStatus": Access.READ,
    "GetConfig": Access.READ,
    "GetConfigHistory": Access.READ,
    "ListCheckpoints": Access.READ,
    "Pause": Access.ADMIN,
    "Resume": Access.ADMIN,
    "UpdateConfig": Access.ADMIN,
    "Checkpoint": Access.ADMIN,
    "Rollback": Access.ADMIN,
    "MarkStable": Access.ADMIN,
    "Stop": Access.ADMIN,
    "Scale": Access.ADMIN,
}


def access_needed(method: str) -> Access:
    """What a call to ``method`` (gRPC's full name, ``/rlpipe.v1.Admin/GetStatus``) needs; ADMIN for anything not
    classified, so that nothing becomes readable by being forgotten."""
    if not method.startswith(ADMIN_SERVICE):
        return Access.ADMIN
    return METHOD_ACCESS.get(method.removeprefix(ADMIN_SERVICE), Access.ADMIN)


class Verdict(StrEnum):
    ADMITTED = "admitted"
    READ_ONLY = "read_only"  # the read token, on a call that needs the admin token: PERMISSION_DENIED
    UNAUTHENTICATED = "unauthenticated"  # neither token: UNAUTHENTICATED


def judge(method: str, authorization: str, admin_token: str, read_token: str) -> Verdict:
    """The decision on a call to ``method`` carrying the ``authorization`` metadata value, against the tokens in force
    (``read_token`` "" = none). Compared in constant time, so the time taken tells nothing of either token.

    A read token equal to the admin token (refused at start, but a rotation of either file can make them so) would
    hand every reader the admin's calls: the token then only reads (fails closed) until one of them changes."""
    given = authorization.encode()
    if not tokens_equal(admin_token, read_token) and hmac.compare_digest(given, f"Bearer {admin_token}".encode()):
        return Verdict.ADMITTED
    if read_token and hmac.compare_digest(given, f"Bearer {read_token}".encode()):
        return Verdict.ADMITTED if access_needed(method) == Access.READ else Verdict.READ_ONLY
    return Verdict.UNAUTHENTICATED


def tokens_equal(admin_token: str, read_token: str) -> bool:
    return bool(read_token) and hmac.compare_digest(admin_token.encode(), read_token.encode())


def read_only_refusal(method: str) -> str:
    """What a caller holding the read token is told on ``method``: the call and what it needs, never a token."""
    return f"the read-only token may not call {method.removeprefix(ADMIN_SERVICE)}: it needs the admin token"


class AdminToken:
    """A token calls may carry: a fixed one, or the content of a file, re-read when the file changes. ``field`` names
    the file's config field in what is logged about it."""

    def __init__(self, fixed: str = "", path: Path | None = None, field: str = "admin.token_file"):
        self.fixed = fixed
        self.path = path
        self.field = field
        # (inode, ctime_ns, mtime_ns, size) of the file when last read: a file replaced by rename, or rewritten
        # within one mtime tick at the same size, is read again
        self._seen: tuple[int, int, int, int] | None = None
        self._token = fixed
        if not fixed and path is not None:
            self.current()

    @classmethod
    def from_config(cls, cfg: RunConfig) -> AdminToken:
        """The admin token; ValueError when there is none (the trainer does not serve Admin without one)."""
        token = cls(AdminCredentials().token, cfg.admin.token_file)
        if not token.current():
            raise ValueError("no admin token: set RLPIPE_ADMIN_TOKEN or admin.token_file (rlpipe run generates one)")
        return token

    @classmethod
    def read_only_from_config(cls, cfg: RunConfig) -> AdminToken | None:
        """The read token; None when neither RLPIPE_ADMIN_READ_TOKEN nor admin.read_token_file is set, ValueError
        when the file holds none (the start checks name what is wrong with it)."""
        fixed, path = AdminCredentials().read_token, cfg.admin.read_token_file
        if not fixed and path is None:
            return None
        token = cls(fixed, path, "admin.read_token_file")
        if not token.current():
            raise ValueError(f"no read token in admin.read_token_file {str(path)!r}: write one or unset the field")
        return token

    def current(self) -> str:
        if self.fixed or self.path is None:
            return self._token
        try:
            stat = self.path.stat()
        except OSError as error:  # moved away mid-rotation: the token in force stands until the new file is there
            log_event(
                log,
                Event.ADMIN_TOKEN_UNREADABLE,
                level=logging.WARNING,
                field=self.field,
                path=str(self.path),
                error=str(error),
            )
            return self._token
        seen = (stat.st_ino, stat.st_ctime_ns, stat.st_mtime_ns, stat.st_size)
        if seen == self._seen:
            return self._token
        self._seen = seen
        try:
            token = read_token_file(self.path, self.field)
        except TokenError as error:  # named, never quoted: the token in force stands
            log_event(  # empty: a file being rewritten, or emptied by mistake
                log,
                Event.ADMIN_TOKEN_EMPTY if error.empty else Event.ADMIN_TOKEN_UNREADABLE,
                level=logging.WARNING,
                field=self.field,
                path=str(self.path),
                error=str(error),
            )
            return self._token
        if token != self._token:
            if self._token:
                log_event(log, Event.ADMIN_TOKEN_ROTATED, field=self.field, path=str(self.path))
            self._token = token
        return self._token


class BearerToken(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection unless it carries ``authorization: Bearer <token>``: the admin
    token for any call, the read token (when there is one) for the calls that only read (``judge``)."""

    def __init__(self, token: AdminToken, read_token: AdminToken | None = None):
        self.token = token
        self.read_token = read_token
        self._said_equal = False

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        if details.method.startswith(OPEN_METHODS):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        admin, read = self.token.current(), self.read_token.current() if self.read_token is not None else ""
        same = tokens_equal(admin, read)
        if same and not self._said_equal:  # said once each time they become equal, naming neither token
            log_event(log, Event.ADMIN_TOKENS_EQUAL, level=logging.ERROR, alert=True)
        self._said_equal = same
        verdict = judge(details.method, given if isinstance(given, str) else "", admin, read)
        if verdict == Verdict.ADMITTED:
            return await continuation(details)
        if verdict == Verdict.READ_ONLY:
            return self._refuse_read_only(details.method)
        return self._refuse_unauthenticated(details.method)

    @staticmethod
    def _refuse_unauthenticated(method: str) -> grpc.RpcMethodHandler:
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            # Said, never the token it carried: a run of these from one peer is someone guessing or a stale token.
            name = method.removeprefix(ADMIN_SERVICE)
            log_event(log, Event.ADMIN_UNAUTHENTICATED, level=logging.WARNING, method=name, peer=context.peer())
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "missing or wrong admin token (metadata authorization: Bearer <token>)"
            )

        return grpc.unary_unary_rpc_method_handler(refuse)

    @staticmethod
    def _refuse_read_only(method: str) -> grpc.RpcMethodHandler:
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            name = method.removeprefix(ADMIN_SERVICE)
            log_event(log, Event.ADMIN_READ_ONLY_REFUSED, level=logging.WARNING, method=name, peer=context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, read_only_refusal(method))

        return grpc.unary_unary_rpc_method_handler(refuse)


def peer_address(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address in gRPC's peer string (``ipv4:10.0.0.5:51234``, ``ipv6:[::1]:51234``, percent-encoded by some
    releases); an IPv4 client on a dual-stack socket as its IPv4 address. None for anything else (a unix socket)."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].removeprefix("[").removesuffix("]").partition("%")[0]
    else:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


class SourceAllowlist(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection from an address outside ``networks`` (PERMISSION_DENIED), before
    the interceptors after it (the token) see it. Admin's methods are all unary: the check wraps those."""

    def __init__(self, networks: list[str]):
        self.networks = [ipaddress.ip_network(network) for network in networks]

    def admits(self, peer: str) -> bool:
        address = peer_address(peer)
        return address is not None and any(address in network for network in self.networks)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        if handler.unary_unary is None:  # a streaming Admin method would pass unchecked: refuse to serve it at all
            raise TypeError(f"{details.method}: SourceAllowlist guards unary methods only")
        inner = handler.unary_unary

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not self.admits(context.peer()):
                log_event(log, Event.ADMIN_SOURCE_REFUSED, level=logging.WARNING, peer=context.peer())
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED, "this address may not call the Admin API (admin.allowed_sources)"
                )
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def _text(value: Any) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        if value is not None
        else "null"
    )


def _config_version(version: Any) -> admin_pb2.ConfigVersion:
    return admin_pb2.ConfigVersion(
        version=version.version,
        author=version.author,
        time=version.time,
        changes=[
            admin_pb2.FieldChange(key=c.key, old_value=_text(c.old), new_value=_text(c.new), live=c.live)
            for c in version.changes
        ],
    )


def checkpoint_info(entry: CatalogEntry) -> admin_pb2.CheckpointInfo:
    return admin_pb2.CheckpointInfo(
        **{k: v for k, v in asdict(entry).items() if k in admin_pb2.CheckpointInfo.DESCRIPTOR.fields_by_name}
    )


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Talks to the trainer's components, never to its loop: commands go through ``control``'s queue."""

    def __init__(self, control: Control, status: StatusReporter, live: LiveConfig, recovery: Recovery):
        self.control = control
        self.reporter = status
        self.live = live
        self.recovery = recovery

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> admin_pb2.Status:
        return await self.reporter.status()

    async def Pause(self, request: admin_pb2.PauseRequest, context: grpc.aio.ServicerContext) -> admin_pb2.Status:
        await self.control.call(lambda: self.control.pause(request.reason or "paused by operator"))
        return await self.reporter.status()

    async def Resume(self, request: Any, context: grpc.aio.ServicerContext) -> admin_pb2.Status:
        await self.control.call(self.control.unpause)
        return await self.reporter.status()

    async def Stop(self, request: admin_pb2.StopRequest, context: grpc.aio.ServicerContext) -> admin_pb2.Status:
        await self.control.call(lambda: self.control.request_stop(request.reason or "stopped by operator"))
        return await self.reporter.status()

    async def Scale(self, request: admin_pb2.ScaleRequest, context: grpc.aio.ServicerContext) -> admin_pb2.ScaleReply:
        """Store the count; the launcher of a local run carries it out (services/common/transport/scale.py)."""
        cfg = self.live.cfg
        try:
            check_scale(request.role, request.replicas, cfg.supervision, cfg.train.deterministic)
        except ScaledElsewhere as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ScaleRefused as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if self.control.state in (RunState.STOPPING, RunState.DONE):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the run is {self.control.state.value}")
        earlier = (await read_scale(self.live.kv)).get(request.role)
        services = await self.reporter.refresh_services(max_age_s=1.0)
        before = earlier.replicas if earlier else configured_replicas(cfg, request.role)
        if before is None:  # rollout.replicas: auto: the launcher's placement chose; count what it started
            before = sum(1 for s in services if s.role == request.role)
        record = await store_scale(self.live.kv, request.role, request.replicas, request.author)
        log_event(
            log, Event.SCALE_REQUESTED, role=record.role, before=before, after=record.replicas, author=record.author
        )
        return admin_pb2.ScaleReply(
            role=record.role,
            replicas_before=before,
            replicas=record.replicas,
            replicas_up=sum(1 for s in services if s.role == record.role and s.up),
        )

    async def UpdateConfig(
        self, request: admin_pb2.UpdateConfigRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ConfigVersion:
        if not request.settings:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no settings given (KEY=VALUE ...)")
        try:
            settings = {s.key: parse_value(s.value) for s in request.settings}
            version = await self.live.propose(settings, request.author, request.dry_run)
        except ConfigError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if not request.dry_run and version.changes:
            log_event(
                log,
                Event.CONFIG_UPDATED,
                config_version=version.version,
                author=version.author,
                changes=[vars(c) for c in version.changes],
            )
            self.control.wake()
        return _config_version(version)

    async def GetConfig(self, request: Any, context: grpc.aio.ServicerContext) -> admin_pb2.ConfigReply:
        live = self.live
        return admin_pb2.ConfigReply(
            version=live.version, yaml=yaml.safe_dump(redacted_dump(live.cfg), sort_keys=False)
        )

    async def GetConfigHistory(self, request: Any, context: grpc.aio.ServicerContext) -> admin_pb2.ConfigHistory:
        return admin_pb2.ConfigHistory(versions=[_config_version(v) for v in await self.live.history()])

    async def Checkpoint(self, request: Any, context: grpc.aio.ServicerContext) -> admin_pb2.CheckpointInfo:
        entry = await self.control.call(lambda: self.recovery.checkpoint_now(self.live.version))
        if entry is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the checkpoint could not be stored; see the trainer log (checkpoint_failed)",
            )
        return checkpoint_info(entry)

    async def ListCheckpoints(self, request: Any, context: grpc.aio.ServicerContext) -> admin_pb2.CheckpointList:
        return admin_pb2.CheckpointList(checkpoints=[checkpoint_info(e) for e in await self.recovery.catalog()])

    async def Rollback(
        self, request: admin_pb2.RollbackRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RollbackReply:
        which = request.WhichOneof("target")
        if which is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give a step or stable")
        step = request.step if which == "step" else None
        try:
            step, version, abandoned = await self.control.call(lambda: self.recovery.rollback(step, "operator"))
        except LookupError as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error.args[0]))
        except CheckpointCorrupt as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        return admin_pb2.RollbackReply(step=step, policy_version=version, abandoned_steps=abandoned)

    async def MarkStable(
        self, request: admin_pb2.MarkStableRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.CheckpointInfo:
        try:
            entry = await self.control.call(lambda: self.recovery.mark_stable(request.step))
        except LookupError as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error.args[0]))
        except AbandonedStep as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        return checkpoint_info(entry)
