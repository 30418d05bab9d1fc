"""The trainer's side of weight sync: holds the newest snapshot, announces versions to watching replicas with their
place in the relay tree, and streams a version's chunks to those that pull from it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from services.common.pb import weights_pb2 as pb
from services.common.pb import weights_pb2_grpc as pb_grpc
from services.common.transport.weightsync.snapshot import NonFiniteWeights, Snapshot, non_finite
from services.common.transport.weightsync.wire import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    chunks_of,
    dtype_named,
)

DEFAULT_FANOUT = 2  # replicas the trainer, and each relay, serves a version to directly


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
        replaced.release()

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
        if address:
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


class StaleVersion(ValueError):
    """A policy version published that is not above the one served: rollouts holding the newer one never pull it,
    and versions must only grow."""


def _landed_non_finite(snapshot: Snapshot) -> list[str]:
    snapshot.wait_copied()
    return non_finite(snapshot.tensors)
