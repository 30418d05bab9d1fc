"""Rollout: PROMPTS -> ROLLOUTS, a group of n completions per prompt, tagged with the policy version.

Weights follow the trainer: a background task watches the trainer's versions over gRPC; before each batch the
newest version is pulled and loaded into the engine in place. Every engine call runs on weights no sync touches
meanwhile (``PolicyFollower.generate``), so each token is tagged with the version that sampled it. A batch's tokens
can come from several versions: with ``rollout.inflight_updates`` the newest version is loaded between chunks of a
batch's samples (services/rollout/partial.py) and before each multi-turn turn, and with ``rollout.episode_batches``
over 1 another batch's sync may come between an episode's turns. A group is tagged with the newest version that
sampled a token of it, and its completions carry per-token versions where they differ from it.
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
import numpy as np
import torch

from services.common.config import RunConfig, SamplingConfig, WeightSyncCredentials
from services.common.episodes.generation import Generation
from services.common.episodes.runner import EpisodeRunner
from services.common.episodes.turns import TurnBatcher
from services.common.model.preprocess import Preprocessor
from services.common.observe.events import Event
from services.common.observe.instruments import record_weight_sync
from services.common.observe.logs import Stopwatch, log_event
from services.common.observe.network import add_network_bytes, watch_network_bytes
from services.common.observe.telemetry import current_telemetry
from services.common.observe.timeshare import StageActivity
from services.common.pb import weights_pb2 as pb
from services.common.seeding import sampling_seed
from services.common.service import announce_ready, join_run, serve_stage, start_grpc_server
from services.common.transport import weight_sync_tls
from services.common.transport.bus import Bus
from services.common.transport.messages import Completion, Prompt, RolloutGroup, advance
from services.common.transport.presence import await_trainer_port
from services.common.transport.stage import Stage
from services.common.transport.streams import PROMPTS, ROLLOUTS
from services.common.transport.weightsync.auth import WeightSyncToken
from services.common.transport.weightsync.client import WeightStream, WeightSyncClient
from services.common.transport.weightsync.relay import Relay, RelayBroken, RelayBuffer, add_relay_to_server
from services.common.transport.weightsync.wire import ChecksumError, dtype_named, dtype_text
from services.rollout.engines import (
    EngineUnavailable,
    WeightTarget,
    build_engine,
    max_tokens_for,
    serving_dtype,
)
from services.rollout.handoff import EngineGone, TensorHandoff
from services.rollout.partial import PartialSample, generate_in_chunks, newest_version

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
    peer that fails (the peer left, or has not got the version) is retried from the trainer."""

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

    def _sources(self) -> list[tuple[str, Callable[[], WeightStream]]]:
        """Where to get the newest version, best first; the trainer is always last."""
        sources: list[tuple[str, Callable[[], WeightStream]]] = []
        current = self.relay.current if self.relay is not None else None
        if current is not None and current.version == self.newest and not (current.done and current.error):
            sources.append(("relay", lambda: WeightStream(raw async for raw, _ in current.read())))
        announced = self.announced
        if not sources and announced is not None and announced.version == self.newest and announced.source:
            peer = self._peer(announced.source)
            sources.append(("peer", lambda: peer.stream(version=announced.version, dtype=self.dtype)))
        sources.append(("trainer", lambda: self.client.stream(dtype=self.dtype)))
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
        for origin, open_stream in self._sources():
            stream = open_stream()
            if await self._load(stream, last=origin == "trainer"):
                self.last_origin = origin
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

    async def _load(self, stream: WeightStream, last: bool) -> bool:
        """Stream one pull into the engine; True once it is loaded. A pull that fails before its first tensor
        leaves the engine as it was; one that fails after leaves it torn."""
        tensors = aiter(stream)
        try:
            # The engine starts loading only once the first tensor is here: a trainer that is down costs
            # nothing, the loaded weights stay whole.
            first = await anext(tensors)
        except (grpc.aio.AioRpcError, ChecksumError, RelayBroken, StopAsyncIteration) as error:
            stream.cancel()
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
        self.loaded, self.torn = stream.version or 0, False
        self.last_buffer_peak = handoff.peak
        return True

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


def completion_of(generation: Generation) -> Completion:
    """A sample the engine generated in one call, as a completion (every token of the group's version)."""
    return Completion(
        text=generation.text,
        token_ids=generation.token_ids,
        logprobs=generation.logprobs,
        finish_reason="stop" if generation.finish_reason == "stop" else "length",
    )


def relays(cfg: RunConfig) -> bool:
    """Whether this replica relays weights: ``rollout.weight_relay``, unless peers would dial its relay by TLS
    (``weight_sync.tls_ca``) while it has no certificate to serve it with (``tls_cert``/``tls_key``): each of their
    pulls would fail and go to the trainer."""
    if not cfg.rollout.weight_relay:
        return False
    if cfg.weight_sync.tls_ca is not None and cfg.weight_sync.tls_cert is None:
        reason = "weight_sync.tls_ca is set without tls_cert/tls_key: peers would dial this relay by TLS"
        log_event(log, Event.WEIGHT_RELAY_OFF, level=logging.WARNING, reason=reason)
        return False
    return True


def relay_address_of(cfg: RunConfig, bound: str) -> str:
    """Where peers reach this replica's relay: rollout.relay_host (the pod IP in k8s) or service.host, at the
    bound gRPC port; "" (no relaying) when only a wildcard bind address is known, as peers cannot dial it."""
    host = cfg.rollout.relay_host or cfg.service.host
    if host in ("0.0.0.0", "::", "[::]", ""):
        log_event(log, Event.WEIGHT_RELAY_OFF, level=logging.WARNING, reason="set rollout.relay_host to this pod's IP")
        return ""
    return f"{host}:{bound.rsplit(':', 1)[1]}"


async def main(cfg: RunConfig, stop: asyncio.Event) -> None:
    started, launched = Stopwatch(), time.time()
    # Every engine call runs on this one thread: vLLM's CPU kernels bind their OpenMP threads to it.
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(engine_thread, build_engine, cfg)
    engine_s = started()
    tokenizer = engine.tokenizer
    bus = await Bus(cfg, "rollout").connect()
    if cfg.service.trainer_grpc_port == 0:  # started with the trainer (rlpipe run): its port is in its presence
        port = await await_trainer_port(bus.js, cfg, since=launched)
        cfg = cfg.model_copy(update={"service": cfg.service.model_copy(update={"trainer_grpc_port": port})})
    relay = Relay() if relays(cfg) else None
    if relay is not None:
        watch_network_bytes("rollout", "weight_sync", "out", lambda: relay.sent_bytes)
    token = WeightSyncCredentials().token
    server, address = await start_grpc_server(
        cfg,
        cfg.service.grpc_port,
        register=(lambda s: [add_relay_to_server(relay, s)]) if relay else None,
        interceptors=[WeightSyncToken(token)] if token else None,
        credentials=weight_sync_tls.server_credentials(cfg, weight_sync_tls.ROLLOUT) if relay else None,
    )
    relay_address = relay_address_of(cfg, address) if relay else ""
    follower = PolicyFollower(
        engine,
        engine_thread,
        WeightSyncClient(
            cfg.trainer_address,
            token=token,
            credentials=weight_sync_tls.channel_credentials(cfg),
            options=weight_sync_tls.name_override(cfg),
        ),
        dtype=dtype_named(serving_dtype(cfg)),
        buffer_bytes=cfg.rollout.weight_buffer_mib << 20,
        relay=relay if relay_address else None,
        relay_address=relay_address,
    )
    with contextlib.suppress(grpc.aio.AioRpcError):
        follower.newest = (await follower.client.version()).version
        await follower.sync()
    watcher = asyncio.create_task(follower.watch())
    live, presence = await join_run(cfg, bus, "rollout", grpc=address)

    async def on_engine(call: Callable[..., T], *args: object) -> T:
        try:
            return await loop.run_in_executor(engine_thread, call, *args)
        except (ValueError, TypeError):
            raise  # the prompts' fault (one too long for max_seq_len, say): their deliveries, then DEAD
        except Exception as error:
            # Anything else is the engine's (a dead engine core, a device error): failing the prompts for it
            # would dead-letter every one of them, so the stage holds them behind its circuit breaker.
            raise EngineUnavailable(f"the {cfg.rollout.backend} engine failed: {error!r}"[:500]) from error

    # In-flight updates need versions published while a batch generates, which a synchronous run never does.
    inflight = cfg.rollout.inflight_updates and not cfg.train.synchronous

    async def on_weights(call: Callable[..., list[Generation]], *args: object) -> list[Generation]:
        """An engine call on whole weights, its generations tagged with their version (the newest, in flight)."""
        generations, version = await follower.on_weights(lambda: on_engine(call, *args), newest=inflight)
        for generation in generations:
            generation.policy_version = version
        return generations

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    # In flight, several batches are in hand (rollout.episode_batches) and their chunks share engine calls: the
    # long tail of one batch's samples fills a call with the next batch's first tokens instead of running alone.
    chunks = TurnBatcher(
        lambda contexts, rooms, sampling: on_weights(engine.generate_turns, contexts, rooms, sampling, [])
    )

    async def in_chunks(prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[list[PartialSample]]:
        """Every sample generated ``inflight_chunk_tokens`` at a time, the newest version loaded in between."""
        n = sampling.group_size
        samples = [
            PartialSample(ids, max_tokens_for(len(ids), sampling, cfg.train.max_seq_len))
            for ids in prompt_ids
            for _ in range(n)
        ]

        async def chunk(contexts: list[list[int]], rooms: list[int]) -> list[Generation]:
            return await chunks.generate(contexts, rooms, sampling)

        await generate_in_chunks(samples, cfg.rollout.inflight_chunk_tokens, chunk)
        return [samples[start : start + n] for start in range(0, len(samples), n)]

    preprocessor = Preprocessor(tokenizer, cfg.model.folder, cfg.data.tokenize_workers)
    await asyncio.to_thread(preprocessor.start)  # seconds with workers, not on the stage's loop
    episodes = (
        EpisodeRunner(cfg, tokenizer, on_weights, engine.generate_turns, engine.end_tokens)
        if cfg.rollout.multi_turn
        else None
    )

    async def compute(prompts: list[Prompt]) -> list[RolloutGroup]:
        # Generating from half-loaded weights would tag wrong logprobs with a version: ready() holds the prompts.
        with stage.time_share.during(StageActivity.BLOCKED):  # waiting for weights, not computing
            await follower.catch_up(max(prompt.min_policy_version for prompt in prompts))
            await follower.ready()
        await live.refresh()  # sampling temperature, top-p and max new tokens are live
        presence.update(policy_version=follower.loaded)
        if episodes is not None:
            return await episodes.groups(prompts, live.cfg.sampling, follower.loaded, live.version)
        prompt_ids = await preprocessor.encode_async([prompt.prompt for prompt in prompts])
        sampling = live.cfg.sampling
        if inflight:
            grown = await in_chunks(prompt_ids, sampling)
            versions = [newest_version(group, follower.loaded) for group in grown]
            completions = [
                [sample.completion(decode, version) for sample in group]
                for group, version in zip(grown, versions, strict=True)
            ]
        else:
            seeds = None
            if cfg.train.deterministic:  # each sample drawn with its own seed (services/common/seeding.py)
                n = sampling.group_size
                seeds = [[sampling_seed(cfg.train.seed, p.group_id, i) for i in range(n)] for p in prompts]
            args = (prompt_ids, sampling, cfg.train.max_seq_len) + ((seeds,) if seeds is not None else ())
            groups, version = await follower.on_weights(lambda: on_engine(engine.generate, *args), newest=False)
            versions = [version] * len(groups)
            completions = [[completion_of(generation) for generation in group] for group in groups]
        return [
            advance(
                prompt,
                RolloutGroup,
                prompt_ids=np.asarray(ids, dtype=np.int32),
                policy_version=version,
                config_version=live.version,
                completions=group,
            )
            for prompt, ids, group, version in zip(prompts, prompt_ids, completions, versions, strict=True)
        ]

    # Multi-turn or in flight: several batches in hand at once, their turns or chunks sharing the engine's calls.
    lanes = cfg.rollout.episode_batches if episodes is not None or inflight else 1
    stage = Stage(bus, PROMPTS, ROLLOUTS, Prompt, compute, cfg.rollout.prompts_per_batch, "rollout", lanes=lanes)
    await announce_ready(
        presence,
        grpc=address,
        metrics_url=current_telemetry().metrics_url,
        backend=cfg.rollout.backend,
        # With model.lora: "adapter" (vLLM hot-loads each version's adapter) or "merge" (merged into the base).
        lora=engine.lora_mode,
        engine_load_s=engine_s,
        policy_version=follower.loaded,
        startup_s=started(),
    )
    try:
        await serve_stage(stage, stop, server, presence)
    finally:
        watcher.cancel()
        await follower.close()
