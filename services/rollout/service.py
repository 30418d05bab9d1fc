"""Rollout: PROMPTS -> ROLLOUTS, a group of n completions per prompt, tagged with the policy version.

Weights follow the trainer: a background task watches the trainer's versions over
gRPC; before each batch the newest version is pulled and loaded into the engine in
place, so every completion of a batch comes from one known version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch

from services.common.bus import PROMPTS, ROLLOUTS, Bus, Stage
from services.common.config import RunConfig
from services.common.logs import Stopwatch, log_event
from services.common.messages import Completion, Prompt, RolloutGroup, advance
from services.common.service import join_run, serve_stage, start_grpc_server
from services.common.telemetry import current_telemetry, record_weight_sync
from services.common.weightsync import ChecksumError, WeightSyncClient, dtype_named
from services.rollout.engines import Engine, EngineUnavailable, build_engine, serving_dtype
from services.rollout.handoff import EngineGone, TensorHandoff

log = logging.getLogger(__name__)


class PolicyFollower:
    """Tracks the trainer's current version and loads it into the engine when asked.

    Latest wins: a sync pulls whatever version is newest when it starts, so a replica that fell
    behind skips the versions in between. Tensors are loaded as they arrive (see ``handoff``), which
    means a pull that breaks after loading began leaves the engine ``torn`` (part old, part new
    weights; in vLLM, layers not loaded at all): the rollout generates nothing until a later sync
    completes."""

    def __init__(
        self,
        engine: Engine,
        engine_thread: ThreadPoolExecutor,
        client: WeightSyncClient,
        dtype: torch.dtype | None = None,
        buffer_bytes: int = 64 << 20,
    ):
        self.engine = engine
        self.engine_thread = engine_thread
        self.client = client
        self.dtype = dtype  # pull floating-point weights in the dtype the engine holds them in
        self.buffer_bytes = buffer_bytes
        self.loaded = 0  # version 0 is the base model the engine started from
        self.newest = 0
        self.torn = False
        self.last_buffer_peak = 0  # bytes held between receiving and loading in the last sync

    async def watch(self) -> None:
        delay = 0.5
        while True:
            try:
                # after_version=0: a (re)connected watch first hears the trainer's current version, which
                # after a trainer restart may differ from anything seen before.
                async for info in self.client.watch(after_version=0):
                    self.newest = info.version
                    delay = 0.5
            except grpc.aio.AioRpcError as error:
                log_event(log, "weight_watch_lost", level=logging.WARNING, code=error.code().name, retry_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def sync(self) -> None:
        """Load the newest version if it is not loaded yet. With the trainer away (restarting), keep the
        loaded one: the batch is tagged with it and the trainer judges its staleness, whereas failing the
        batch would spend its deliveries and, in a long outage, dead-letter healthy prompts."""
        if self.newest == self.loaded and not self.torn:
            return
        started = time.perf_counter()
        stream = self.client.stream(dtype=self.dtype)
        tensors = aiter(stream)
        try:
            # The engine starts loading only once the first tensor is here: a trainer that is down costs
            # nothing, the loaded weights stay whole.
            first = await anext(tensors)
        except (grpc.aio.AioRpcError, ChecksumError) as error:
            self._deferred(error)
            return
        loop = asyncio.get_running_loop()
        handoff = TensorHandoff(loop, self.buffer_bytes)
        load = loop.run_in_executor(self.engine_thread, self.engine.load_weights, handoff)
        handoff.watch(load)
        try:
            await handoff.put(*first)
            async for name, tensor in tensors:
                await handoff.put(name, tensor)
            handoff.close()
        except (grpc.aio.AioRpcError, ChecksumError) as error:
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
                "weight_sync_torn",
                level=logging.ERROR,
                error=repr(error)[:300],
                loaded=self.loaded,
                newest=self.newest,
            )
            return
        self.loaded, self.torn = stream.version or 0, False
        self.last_buffer_peak = handoff.peak
        seconds = time.perf_counter() - started
        record_weight_sync(seconds, stream.data_bytes, self.loaded)
        log_event(
            log,
            "weights_loaded",
            version=self.loaded,
            bytes=stream.data_bytes,
            buffer_peak=handoff.peak,
            sync_s=round(seconds, 3),
        )

    def _deferred(self, error: BaseException) -> None:
        code = error.code().name if isinstance(error, grpc.aio.AioRpcError) else type(error).__name__
        log_event(log, "weight_sync_deferred", level=logging.WARNING, code=code, loaded=self.loaded, newest=self.newest)


async def main(cfg: RunConfig, stop: asyncio.Event) -> None:
    started = Stopwatch()
    # Every engine call runs on this one thread: vLLM's CPU kernels bind their OpenMP threads to it.
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(engine_thread, build_engine, cfg)
    engine_s = started()
    tokenizer = engine.tokenizer
    bus = await Bus(cfg, "rollout").connect()
    server, address = await start_grpc_server(cfg, cfg.service.grpc_port)
    follower = PolicyFollower(
        engine,
        engine_thread,
        WeightSyncClient(cfg.trainer_address),
        dtype=dtype_named(serving_dtype(cfg)),
        buffer_bytes=cfg.rollout.weight_buffer_mib << 20,
    )
    with contextlib.suppress(grpc.aio.AioRpcError):
        follower.newest = (await follower.client.version()).version
        await follower.sync()
    watcher = asyncio.create_task(follower.watch())
    live, presence = await join_run(cfg, bus, "rollout", grpc=address)

    async def compute(prompts: list[Prompt]) -> list[RolloutGroup]:
        await follower.sync()
        if follower.torn:
            # Generating from half-loaded weights would tag wrong logprobs with a version: hold the prompts.
            raise EngineUnavailable("a weight sync broke off midway; waiting for a complete one")
        await live.refresh()  # sampling temperature, top-p and max new tokens are live
        presence.update(policy_version=follower.loaded)
        prompt_ids = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in prompts]
        try:
            groups = await loop.run_in_executor(
                engine_thread, engine.generate, prompt_ids, live.cfg.sampling, cfg.train.max_seq_len
            )
        except (ValueError, TypeError):
            raise  # the prompts' fault (one too long for max_seq_len, say): their deliveries, then DEAD
        except Exception as error:
            # Anything else is the engine's (a dead engine core, a device error): failing the prompts for it
            # would dead-letter every one of them, so the stage holds them behind its circuit breaker.
            raise EngineUnavailable(f"the {cfg.rollout.backend} engine failed: {error!r}"[:500]) from error
        return [
            advance(
                prompt,
                RolloutGroup,
                prompt_ids=np.asarray(ids, dtype=np.int32),
                policy_version=follower.loaded,
                config_version=live.version,
                completions=[Completion(**vars(generation)) for generation in group],
            )
            for prompt, ids, group in zip(prompts, prompt_ids, groups, strict=False)
        ]

    stage = Stage(bus, PROMPTS, ROLLOUTS, Prompt, compute, cfg.rollout.prompts_per_batch, "rollout")
    log_event(
        log,
        "ready",
        grpc=address,
        metrics_url=current_telemetry().metrics_url,
        backend=cfg.rollout.backend,
        engine_load_s=engine_s,
        policy_version=follower.loaded,
        startup_s=started(),
    )
    try:
        await serve_stage(stage, stop, server, presence)
    finally:
        watcher.cancel()
        await follower.client.close()
