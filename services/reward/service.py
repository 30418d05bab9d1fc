"""Reward: ROLLOUTS -> SCORED, one scalar reward per completion."""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from services.common.bus import ROLLOUTS, SCORED, Bus, Stage
from services.common.config import RunConfig
from services.common.logs import Stopwatch, log_event
from services.common.messages import RolloutGroup, ScoredGroup, advance
from services.common.service import join_run, serve_stage, start_grpc_server
from services.common.telemetry import current_telemetry
from services.reward.functions import score

log = logging.getLogger(__name__)


def score_group(group: RolloutGroup, weights: dict[str, float], config_version: int = 0) -> ScoredGroup:
    rewards = [score(c.text, group.answer, c.finish_reason, weights) for c in group.completions]
    return advance(group, ScoredGroup, rewards=np.asarray(rewards, dtype=np.float32), config_version=config_version)


async def main(cfg: RunConfig, stop: asyncio.Event) -> None:
    started = Stopwatch()
    bus = await Bus(cfg, "reward").connect()
    server, address = await start_grpc_server(cfg, cfg.service.grpc_port)
    live, presence = await join_run(cfg, bus, "reward", grpc=address)

    async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
        await live.refresh()  # reward weights are live
        return [score_group(group, live.cfg.reward.functions, live.version) for group in groups]

    stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, cfg.reward.batch, "reward")
    log_event(
        log,
        "ready",
        grpc=address,
        metrics_url=current_telemetry().metrics_url,
        functions=live.cfg.reward.functions,
        config_version=live.version,
        startup_s=started(),
    )
    await serve_stage(stage, stop, server, presence)
