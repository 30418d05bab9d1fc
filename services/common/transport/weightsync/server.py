"""The trainer's side of weight sync: holds the newest snapshot, announces versions to watching replicas with their
place in the relay tree, streams a version's chunks to those that pull from it, and vouches for a version's digest
to those that got it through relays."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncIterator

import grpc
import torch

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.pb import weights_pb2 as pb
from services.common.pb import weights_pb2_grpc as pb_grpc
from services.common.transport.weightsync.snapshot import NonFiniteWeights, Snapshot, non_finite
from services.common.transport.weightsync.wire import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    chunks_of,
    digest_key,
    digest_of,
    dtype_named,
)

log = logging.getLogger(__name__)

DEFAULT_FANOUT = 2  # replicas the trainer, and each relay, serves a version to directly
# Versions whose digests are kept after the next one replaces them: a replica deep in the tree may ask for the
# digest of a version just after the trainer moved on.
DIGEST_HISTORY = 8
RESOLVE_TIMEOUT_S = 5.0

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def peer_ip(peer: str) -> IPAddress | None:
    """The IP of a gRPC peer string (``ipv4:10.0.0.5:41000``, ``ipv6:[::1]:41000``); None for any other kind (a
    unix socket). An IPv4 address seen through an IPv6 socket (``::ffff:10.0.0.5``) is its IPv4 address."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def address_host(address: str) -> str:
    """The host of ``host:port`` or ``[v6]:port``."""
    return address.rsplit(":", 1)[0].strip("[]") if ":" in address else address


async def host_ips(host: str) -> set[IPAddress]:
    """The addresses ``host`` stands for: itself when it is an IP, else what it resolves to (nothing if it does
    not resolve in time)."""
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        found = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None), RESOLVE_TIMEOUT_S)
    except (OSError, TimeoutError):
        return set()
    ips: set[IPAddress] = set()
    for *_, sockaddr in found:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        ips.add(mapped if mapped is not None else ip)
    return ips


async def own_relay_address(address: str, peer: str) -> bool:
    """Whether ``address`` (a watcher's relay_address) is on the host the watch came from (any port): a replica
    may offer only itself as a relay, never place another address, one it controls elsewhere, in the tree."""
    ip = peer_ip(peer)
    return ip is not None and ip in await host_ips(address_host(address))


def relay_route(plan: tuple[str, ...], address: str, fanout: int) -> tuple[str, bool]:
    """Where the replica at ``address`` pulls a version from ("" = the trainer) and whether it relays it.

    ``plan`` lists the relaying replicas in join order as a complete ``fanout``-ary tree under the trainer:
    the first ``fanout`` are the trainer's children, and replica ``i``'s children are
    ``fanout * (i + 1)`` onwards. A replica outside the plan (joined after the version was published, or a
    client that does not relay) pulls from the trainer."""
    if fanout < 1 or address not in plan:
        return "", False
    at = plan.index(address)
    parent = plan[(at - fanout) // fanout] if at >= fanout else ""
    return parent, fanout * (at + 1) < len(plan)


class WeightSyncServer(pb_grpc.WeightSyncServicer):
    """Holds the newest snapshot and wakes watchers when a new one is published.

    ``fanout`` bounds how many replicas pull each version from here (0: every replica does, as before
    relaying); the rest get it from a peer, see :func:`relay_route`."""

    def __init__(self, initial: Snapshot, fanout: int = DEFAULT_FANOUT):
        initial.wait_copied()  # served from the first pull on, so its copy from a GPU must have landed (ms)
        self.latest = initial
        self.fanout = fanout
        self.sent_bytes = 0  # tensor data streamed by PullWeights, all versions: what the trainer's egress pays
        self._changed = asyncio.Condition()
        # Digests of the versions replaced, by (version, dtype text, aliases); the newest DIGEST_HISTORY versions.
        self._digests: dict[tuple[int, str, bool], bytes] = {}
        # A digest being computed for a GetDigest that came before any pull of its (version, dtype): asked once.
        self._digesting: dict[tuple[int, str, bool], asyncio.Task[bytes]] = {}
        # Open watch streams per relay address, in join order (dicts keep insertion order).
        self._members: dict[str, int] = {}
        # The tree of the latest version, fixed at publish: every replica is told its part of one tree.
        self._plan: tuple[str, ...] = ()

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self._members)

    async def publish(self, snapshot: Snapshot) -> None:
        """Serve ``snapshot`` as the newest version, once its copy has landed; raises ``NonFiniteWeights`` (and
        keeps serving the previous one) when a tensor holds NaN or inf: a rollout that loaded it would sample
        garbage for every prompt. Versions only grow: one not above the version served is a ``StaleVersion``.

        Takes over the snapshot's hold on its host memory (``HostStaging``): kept while it is served, given back when
        the next version replaces it or when it is refused."""
        try:
            broken = await asyncio.to_thread(_landed_non_finite, snapshot)
            if broken:
                raise NonFiniteWeights(
                    f"policy version {snapshot.version} (step {snapshot.step}) is not served: {len(broken)} "
                    f"tensor(s) hold NaN or inf ({', '.join(broken[:3])}{', ...' if len(broken) > 3 else ''}); "
                    f"rollouts keep version {self.latest.version}"
                )
            async with self._changed:
                if snapshot.version <= self.latest.version:  # judged here: another publish may have landed meanwhile
                    raise StaleVersion(
                        f"policy version {snapshot.version} is not above version {self.latest.version}, served"
                    )
                replaced, self.latest = self.latest, snapshot
                self._plan = tuple(self._members)
                self._changed.notify_all()
        except BaseException:
            snapshot.release()
            raise
        self._keep_digests(replaced)
        replaced.release()

    def _keep_digests(self, replaced: Snapshot) -> None:
        for (dtype, aliases), digest in replaced.digests.items():
            self._digests[(replaced.version, dtype, aliases)] = digest
        kept = sorted({version for version, _, _ in self._digests})[-DIGEST_HISTORY:]
        self._digests = {key: digest for key, digest in self._digests.items() if key[0] in kept}

    def announcement(self, snapshot: Snapshot, address: str) -> pb.PolicyVersion:
        info = snapshot.info()
        if snapshot is self.latest:
            info.source, info.relay = relay_route(self._plan, address, self.fanout)
        return info

    async def GetVersion(self, request: pb.GetVersionRequest, context: grpc.aio.ServicerContext) -> pb.PolicyVersion:
        return self.latest.info()

    async def WatchVersions(
        self, request: pb.WatchVersionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PolicyVersion]:
        seen = request.after_version
        address = request.relay_address
        if address and not await own_relay_address(address, context.peer()):
            # Announced as a plain watcher: it pulls from the trainer, and nobody is sent to that address.
            log_event(
                log,
                Event.WEIGHT_RELAY_ADDRESS_REFUSED,
                level=logging.WARNING,
                relay_address=address,
                peer=context.peer(),
            )
            address = ""
        if address:  # one entry per watch stream, under the address it gave
            self._members[address] = self._members.get(address, 0) + 1
        try:
            while True:
                async with self._changed:
                    # Bound now (the default), so the predicate reads this pass's `seen`, not whatever the loop
                    # set later.
                    await self._changed.wait_for(lambda after=seen: self.latest.version > after)
                    current = self.latest
                seen = current.version
                yield self.announcement(current, address)
        finally:  # the stream ended (the replica went away): later versions' trees leave it out
            if address:
                self._members[address] -= 1  # in place: a replica with a second stream keeps its position
                if not self._members[address]:
                    del self._members[address]

    async def PullWeights(
        self, request: pb.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WeightChunk]:
        # Taken once, and held while it streams: the whole stream is this version even if the trainer publishes
        # the next ones meanwhile, whose copies then go to other host memory.
        snapshot = self.latest
        snapshot.hold()
        try:
            if request.version and request.version != snapshot.version:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"version {request.version} is gone; newest is {snapshot.version}"
                )
            try:
                dtype = dtype_named(request.dtype) if request.dtype else None
            except ValueError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            chunk_bytes = min(max(request.chunk_bytes or CHUNK_BYTES, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
            for chunk in chunks_of(snapshot, chunk_bytes, dtype, request.accept_aliases):
                self.sent_bytes += len(chunk.data)
                yield chunk
        finally:
            snapshot.release()

    async def GetDigest(self, request: pb.DigestRequest, context: grpc.aio.ServicerContext) -> pb.WeightsDigest:
        """The digest of ``request.version`` streamed in ``request.dtype``: as kept by the pull that served it, else
        computed now (on a worker thread, from the snapshot itself: no chunk is sent). NOT_FOUND for a version
        neither served now nor among the last DIGEST_HISTORY."""
        try:
            dtype = dtype_named(request.dtype) if request.dtype else None
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        key = digest_key(dtype, request.accept_aliases)
        snapshot = self.latest
        version = request.version or snapshot.version
        digest = snapshot.digests.get(key) if version == snapshot.version else self._digests.get((version, *key))
        if digest is None and version == snapshot.version:
            digest = await self._digest_now(snapshot, dtype, request.accept_aliases)
        if digest is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no digest of version {version}; newest is {snapshot.version}"
            )
        return pb.WeightsDigest(version=version, sha256=digest)

    async def _digest_now(self, snapshot: Snapshot, dtype: torch.dtype | None, aliases: bool) -> bytes:
        kept = digest_key(dtype, aliases)
        key = (snapshot.version, *kept)
        task = self._digesting.get(key)
        if task is None:
            snapshot.hold()  # its host memory is not refilled while it is read

            async def compute() -> bytes:
                try:
                    digest = snapshot.digests.setdefault(
                        kept, await asyncio.to_thread(digest_of, snapshot, dtype, aliases)
                    )
                    if snapshot is not self.latest:  # replaced meanwhile: its digests were kept without this one
                        self._keep_digests(snapshot)
                    return digest
                finally:
                    snapshot.release()
                    self._digesting.pop(key, None)

            task = self._digesting[key] = asyncio.create_task(compute())
        # Shielded: one caller going away does not cancel the digest the others wait for.
        return await asyncio.shield(task)


class StaleVersion(ValueError):
    """A policy version published that is not above the one served: rollouts holding the newer one never pull it,
    and versions must only grow."""


def _landed_non_finite(snapshot: Snapshot) -> list[str]:
    snapshot.wait_copied()
    return non_finite(snapshot.tensors)
