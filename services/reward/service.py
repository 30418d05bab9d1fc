"""Reward: ROLLOUTS -> SCORED, one scalar reward per completion."""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from services.common.bus import ROLLOUTS, SCORED, Bus, Stage
from services.common.config import RunConfig
from services.common.logs import Stopwatch, log_event
from services.common.messages import RolloutGroup, ScoredGroup, advance
from services.common.service import serve_stage, start_grpc_server
from services.reward.functions import score

log = logging.getLogger(__name__)


def score_group(group: RolloutGroup, weights: dict[str, float]) -> ScoredGroup:
    rewards = [score(c.text, group.answer, c.finish_reason, weights) for c in group.completions]
    return advance(group, ScoredGroup, rewards=np.asarray(rewards, dtype=np.float32))


async def main(cfg: RunConfig, stop: asyncio.Event) -> None:
    started = Stopwatch()
    bus = await Bus(cfg, "reward").connect()
    server, address = await start_grpc_server(cfg, cfg.service.grpc_port)

    async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
        return [score_group(group, cfg.reward.functions) for group in groups]

    stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, cfg.reward.batch, "reward")
    log_event(log, "ready", grpc=address, functions=cfg.reward.functions, startup_s=started())
    await serve_stage(stage, stop, server)
