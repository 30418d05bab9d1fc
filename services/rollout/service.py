"""Rollout: PROMPTS -> ROLLOUTS, a group of n completions per prompt, tagged with the policy version.

Weights follow the trainer: a background task watches the trainer's versions over gRPC; before each batch the
newest version is pulled and loaded into the engine in place. Every engine call runs on weights no sync touches
meanwhile (``PolicyFollower.on_weights``), so each token is tagged with the version that sampled it. A batch's tokens
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import numpy as np

from services.common.config import RunConfig, SamplingConfig, WeightSyncCredentials
from services.common.episodes.generation import Generation
from services.common.episodes.runner import EpisodeRunner
from services.common.episodes.turns import TurnBatcher
from services.common.model.preprocess import Preprocessor
from services.common.observe.events import Event
from services.common.observe.logs import Stopwatch, log_event
from services.common.observe.network import watch_network_bytes
from services.common.observe.telemetry import current_telemetry
from services.common.observe.timeshare import StageActivity
from services.common.seeding import sampling_seed
from services.common.service import announce_ready, join_run, serve_stage, start_grpc_server
from services.common.transport import weight_sync_tls
from services.common.transport.bus import Bus
from services.common.transport.messages import Prompt, RolloutGroup, advance
from services.common.transport.presence import await_trainer_port
from services.common.transport.stage import Stage
from services.common.transport.streams import PROMPTS, ROLLOUTS
from services.common.transport.weightsync.auth import WeightSyncToken
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.relay import Relay, add_relay_to_server
from services.common.transport.weightsync.wire import dtype_named
from services.rollout.engines import EngineUnavailable, build_engine, max_tokens_for, serving_dtype
from services.rollout.follower import PolicyFollower
from services.rollout.partial import PartialSample, generate_in_chunks, newest_version

log = logging.getLogger(__name__)
T = TypeVar("T")


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
            completions = [[generation.completion() for generation in group] for group in groups]
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
