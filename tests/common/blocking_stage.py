"""A stage that blocks its own event loop, run as a service by tests/test_stalls.py in a process of its own (that
process must end by itself, so it imports only what a stage imports: the test modules pull in torch)."""

from __future__ import annotations

import asyncio
import time

from services.common.config import RunConfig
from services.common.service import serve_stage, start_grpc_server
from services.common.transport.bus import Bus
from services.common.transport.messages import RolloutGroup, ScoredGroup, advance
from services.common.transport.presence import Presence
from services.common.transport.stage import Stage
from services.common.transport.streams import ROLLOUTS, SCORED


async def event_loop_blocking_stage(cfg: RunConfig, stop: asyncio.Event) -> None:
    """A reward stage whose compute blocks the event loop itself (a sync call in an async function), so nothing on
    that loop, its own watchdog included, can notice the stall: only ``exit_when_stalled``'s thread can."""
    bus = await Bus(cfg, "reward").connect()
    server, address = await start_grpc_server(cfg, 0)
    presence = await Presence(bus.js, cfg, "reward").start(grpc=address)

    async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
        time.sleep(3600)  # blocks the loop: the stall under test
        return [advance(g, ScoredGroup, rewards=[0.0] * len(g.completions)) for g in groups]

    await serve_stage(Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 1, "reward"), stop, server, presence)
