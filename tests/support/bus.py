"""A stage's loop and a run's streams from a test: the loop running for a block, how many messages an edge holds,
and waiting until it holds enough."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.common.transport.bus import Bus
from services.common.transport.stage import Stage
from services.common.transport.streams import stream_name
from tests.support.waits import until


async def stream_messages(bus: Bus, edge: str) -> int:
    """How many messages the stream of ``edge`` (ROLLOUTS, DEAD, ...) of ``bus``'s run holds."""
    return (await bus.js.stream_info(stream_name(bus.run_id, edge))).state.messages


async def until_messages(bus: Bus, edge: str, count: int, timeout: float = 30.0) -> None:
    """Return once the stream of ``edge`` holds ``count`` messages or more; fail after ``timeout`` seconds."""

    async def reached() -> bool:
        return await stream_messages(bus, edge) >= count

    await until(reached, timeout, f"{count} messages in {edge}", poll=0.1)


@contextlib.asynccontextmanager
async def running(stage: Stage) -> AsyncIterator[asyncio.Task]:
    """``stage``'s loop running in the background for the block; stopped, and waited for, after it."""
    stop = asyncio.Event()
    task = asyncio.create_task(stage.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await task
