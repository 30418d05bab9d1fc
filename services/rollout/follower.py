"""The rollout's weights: which policy version the engine holds, and loading the newest one into it.

``PolicyFollower`` watches the trainer's versions over gRPC and pulls a version when asked (before a batch, or
between chunks of one in flight), from a peer's relay where one is announced, else from the trainer. Every engine
call runs under its sync lock (``on_weights``), so the version a call's tokens are tagged with is the one whose
weights sampled them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import torch

from services.common.observe.events import Event
from services.common.observe.instruments import record_weight_sync
from services.common.observe.logs import log_event
from services.common.observe.network import add_network_bytes
from services.common.pb import weights_pb2 as pb
from services.common.transport.weightsync.client import WeightStream, WeightSyncClient
from services.common.transport.weightsync.relay import Relay, RelayBroken, RelayBuffer
from services.common.transport.weightsync.wire import ChecksumError, UnverifiedWeights, dtype_text
from services.rollout.engines import EngineUnavailable, WeightTarget
from services.rollout.handoff import EngineGone, TensorHandoff

log = logging.getLogger(__name__)
T = TypeVar("T")


class PolicyFollower:
    """Tracks the trainer's current version and loads it into the engine when asked.

    Latest wins: a sync pulls whatever version is newest when it starts, so a replica that fell
    behind skips the versions in between. Tensors are loaded as they arrive (see ``handoff``), which
    means a pull that breaks after loading began leaves the engine ``torn`` (part old, part new
    weights; in vLLM, layers not loaded at all): the rollout generates nothing until a later sync
    completes (:meth:`ready`).

    With a ``relay`` (and the ``relay_address`` peers reach it at), the replica joins the trainer's relay
    tree: each announcement names where to pull from (a peer, or the trainer) and whether to relay. A
    relaying replica pulls the version at once, in the background, into its relay (children stream from
    it as it arrives) and later loads it from there; the others pull at their next sync. A pull from a
    peer that fails (the peer left, or has not got the version) is retried from the trainer.

    A peer is not trusted with the weights (every rollout holds the token and, under TLS, the same certificate):
    a version whose chunks came from a peer must be the version asked for, or it is refused before loading, and
    once loaded its digest must be the one the trainer gives (``GetDigest``), or the engine is torn and the
    version pulled from the trainer (``weight_relay_forged``)."""

    def __init__(
        self,
        engine: WeightTarget,
        engine_thread: ThreadPoolExecutor,
        client: WeightSyncClient,
        dtype: torch.dtype | None = None,
        buffer_bytes: int = 64 << 20,
        relay: Relay | None = None,
        relay_address: str = "",
    ):
        self.engine = engine
        self.engine_thread = engine_thread
        self.client = client
        self.dtype = dtype  # pull floating-point weights in the dtype the engine holds them in
        self.buffer_bytes = buffer_bytes
        self.relay = relay
        self.relay_address = relay_address if relay is not None else ""
        self.loaded = 0  # version 0 is the base model the engine started from
        self.newest = 0
        self.announced: pb.PolicyVersion | None = None  # the newest announcement: where to pull it from
        self.torn = False
        self.last_buffer_peak = 0  # bytes held between receiving and loading in the last sync
        self.last_origin = ""  # where the last loaded version came from: "relay", "peer" or "trainer"
        self._peers: dict[str, WeightSyncClient] = {}
        self._prefetch: asyncio.Task[None] | None = None
        self._syncing = asyncio.Lock()  # batches in hand at once (the stage's lanes) pull a version once

    async def watch(self) -> None:
        delay = 0.5
        while True:
            try:
                # after_version=0: a (re)connected watch first hears the trainer's current version, which
                # after a trainer restart may differ from anything seen before.
                async for info in self.client.watch(after_version=0, relay_address=self.relay_address):
                    self.newest, self.announced = info.version, info
                    if info.relay and self.relay is not None:
                        await self._start_relaying(info)
                    delay = 0.5
            except grpc.aio.AioRpcError as error:
                log_event(log, Event.WEIGHT_WATCH_LOST, level=logging.WARNING, code=error.code().name, retry_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def _start_relaying(self, info: pb.PolicyVersion) -> None:
        assert self.relay is not None
        if self._prefetch is not None:
            self._prefetch.cancel()  # latest wins here too; its children fall back to the trainer
        buffer = await self.relay.begin(info.version, dtype_text(self.dtype))
        self._prefetch = asyncio.create_task(self._fill(buffer, info.source))

    async def _fill(self, buffer: RelayBuffer, source: str) -> None:
        """Pull the version being relayed: from the parent, or from the trainer if the parent fails before
        sending anything (once children have part of it, they fall back themselves)."""
        clients = [self._peer(source), self.client] if source else [self.client]
        for client in clients:
            buffer.origin = source if client is not self.client else ""
            try:
                await buffer.fill(client.raw(version=buffer.version, dtype=self.dtype))
                return
            except grpc.aio.AioRpcError as error:
                log_event(
                    log,
                    Event.WEIGHT_RELAY_PULL_FAILED,
                    level=logging.WARNING,
                    code=error.code().name,
                    source=source if client is not self.client else "trainer",
                    version=buffer.version,
                )
                if buffer.done:
                    return
        buffer.finish(RelayBroken("no source had the version"))

    def _peer(self, address: str) -> WeightSyncClient:
        client = self._peers.get(address)
        if client is None:
            # A peer's relay port speaks what the trainer's does (weight_sync_tls), and asks for the same token.
            client = self._peers[address] = WeightSyncClient(
                address,
                chunk_bytes=self.client.chunk_bytes,
                token=self.client.token,
                credentials=self.client.credentials,
                options=self.client.options,
            )
        return client

    def _sources(self) -> list[tuple[str, str, Callable[[], WeightStream]]]:
        """Where to get the newest version, best first, as (origin, the peer its chunks come from or "" for the
        trainer, the pull); the trainer is always last."""
        sources: list[tuple[str, str, Callable[[], WeightStream]]] = []
        current = self.relay.current if self.relay is not None else None
        if current is not None and current.version == self.newest and not (current.done and current.error):
            checked = bool(current.origin)  # relayed from a peer: checked as a pull from a peer is
            sources.append(
                (
                    "relay",
                    current.origin,
                    lambda: WeightStream(
                        (raw async for raw, _ in current.read()),
                        expect_version=current.version if checked else None,
                        digest=checked,
                    ),
                )
            )
        announced = self.announced
        if not sources and announced is not None and announced.version == self.newest and announced.source:
            peer = self._peer(announced.source)
            sources.append(
                (
                    "peer",
                    announced.source,
                    lambda: peer.stream(version=announced.version, dtype=self.dtype, peer=True),
                )
            )
        sources.append(("trainer", "", lambda: self.client.stream(dtype=self.dtype)))
        return sources

    async def catch_up(self, version: int) -> None:
        """Learn of ``version`` before its announcement arrives: a prompt that asks for it (train.synchronous) was
        fed after the trainer published it, and may overtake the watch stream's announcement."""
        if self.newest < version:
            with contextlib.suppress(grpc.aio.AioRpcError):  # the trainer away: the loaded version, judged by it
                self.newest = max(self.newest, (await self.client.version()).version)

    async def ready(self) -> int:
        """Sync, then the loaded version; raises EngineUnavailable while the engine is torn (a sync broke off
        after loading began), so the stage holds its prompts instead of tagging half-loaded weights."""
        await self.sync()
        if self.torn:
            raise EngineUnavailable("a weight sync broke off midway; waiting for a complete one")
        return self.loaded

    async def on_weights(self, call: Callable[[], Awaitable[T]], newest: bool) -> tuple[T, int]:
        """Run the engine ``call`` on whole weights: its result and the version of the weights it ran on. With
        ``newest``, the newest version is loaded first (in-flight updates). No sync starts while the call runs, so
        the version is the one that sampled; raises EngineUnavailable while the engine is torn."""
        if newest:
            await self.ready()
        async with self._syncing:
            if self.torn:
                raise EngineUnavailable("a weight sync broke off midway; waiting for a complete one")
            return await call(), self.loaded

    async def sync(self) -> None:
        """Load the newest version if it is not loaded yet. With the trainer away (restarting), keep the
        loaded one: the batch is tagged with it and the trainer judges its staleness, whereas failing the
        batch would spend its deliveries and, in a long outage, dead-letter healthy prompts."""
        async with self._syncing:
            if self.newest != self.loaded or self.torn:
                await self._sync()

    async def _sync(self) -> None:
        started = time.perf_counter()
        for origin, peer, open_stream in self._sources():
            stream = open_stream()
            if await self._load(stream, last=origin == "trainer", peer=peer):
                self.last_origin = origin
                # The trainer serves its newest version, which may be ahead of the announcement heard so far: the
                # next sync must neither pull it again nor go back to the version announced.
                self.newest = max(self.newest, self.loaded)
                seconds = time.perf_counter() - started
                record_weight_sync(seconds, stream.data_bytes, self.loaded)
                add_network_bytes("rollout", "weight_sync", "in", stream.data_bytes)
                log_event(
                    log,
                    Event.WEIGHTS_LOADED,
                    version=self.loaded,
                    origin=origin,
                    bytes=stream.data_bytes,
                    buffer_peak=self.last_buffer_peak,
                    sync_s=round(seconds, 3),
                )
                return
            if origin != "trainer":
                log_event(log, Event.WEIGHT_RELAY_FALLBACK, level=logging.WARNING, origin=origin, torn=self.torn)

    async def _load(self, stream: WeightStream, last: bool, peer: str = "") -> bool:
        """Stream one pull into the engine; True once it is loaded. A pull that fails before its first tensor
        leaves the engine as it was; one that fails after leaves it torn. A stream whose chunks came from a
        ``peer`` counts only once the trainer confirms its digest; otherwise the engine is left torn."""
        tensors = aiter(stream)
        try:
            # The engine starts loading only once the first tensor is here: a trainer that is down costs
            # nothing, the loaded weights stay whole.
            first = await anext(tensors)
        except (grpc.aio.AioRpcError, ChecksumError, RelayBroken, StopAsyncIteration) as error:
            stream.cancel()
            if isinstance(error, UnverifiedWeights):
                self._forged(peer, self.newest, str(error))
            if last:
                self._deferred(error)
            return False
        loop = asyncio.get_running_loop()
        handoff = TensorHandoff(loop, self.buffer_bytes)
        load = loop.run_in_executor(self.engine_thread, self.engine.load_weights, handoff)
        handoff.watch(load)
        try:
            await handoff.put(*first)
            async for name, tensor in tensors:
                await handoff.put(name, tensor)
            handoff.close()
        except (grpc.aio.AioRpcError, ChecksumError, RelayBroken) as error:
            handoff.close(error)
        except EngineGone:
            pass  # the load's own error is raised below
        except BaseException as error:  # cancelled mid-sync: the engine thread must not wait forever
            handoff.close(error)
            self.torn = True
            raise
        try:
            await load
        except Exception as error:
            self.torn = True
            stream.cancel()
            log_event(
                log,
                Event.WEIGHT_SYNC_TORN,
                level=logging.ERROR,
                error=repr(error)[:300],
                loaded=self.loaded,
                newest=self.newest,
            )
            return False
        if peer:
            self.torn = True  # until the trainer vouches for the weights the engine now holds, no batch runs on them
            if not await self._vouched(stream, peer):
                return False
        self.loaded, self.torn = stream.version or 0, False
        self.last_buffer_peak = handoff.peak
        return True

    async def _vouched(self, stream: WeightStream, peer: str) -> bool:
        """Whether the trainer confirms the digest of ``stream``, which came whole from ``peer``."""
        version = stream.version or 0
        try:
            trainers = await self.client.digest(version, self.dtype)
        except grpc.aio.AioRpcError as error:  # the trainer away, or past the version: unconfirmed is refused
            log_event(
                log,
                Event.WEIGHT_RELAY_PULL_FAILED,
                level=logging.WARNING,
                code=error.code().name,
                source=peer,
                version=version,
                reason="the trainer did not confirm the digest",
            )
            return False
        if trainers != stream.digest():
            self._forged(peer, version, "its digest is not the trainer's")
            return False
        return True

    def _forged(self, peer: str, version: int, reason: str) -> None:
        log_event(log, Event.WEIGHT_RELAY_FORGED, level=logging.ERROR, peer=peer, version=version, reason=reason)
        current = self.relay.current if self.relay is not None else None
        if current is not None and current.origin == peer and current.version == version:
            current.discard(UnverifiedWeights(f"version {version} from {peer}: {reason}"))

    def _deferred(self, error: BaseException) -> None:
        code = error.code().name if isinstance(error, grpc.aio.AioRpcError) else type(error).__name__
        log_event(
            log, Event.WEIGHT_SYNC_DEFERRED, level=logging.WARNING, code=code, loaded=self.loaded, newest=self.newest
        )

    async def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()
        for client in (self.client, *self._peers.values()):
            await client.close()
