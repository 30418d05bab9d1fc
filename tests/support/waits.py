"""Waiting on a condition with a deadline, inside a test's event loop (``runs.wait_for`` waits on a whole run)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def until(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0, what: str = "", poll: float = 0.05
) -> None:
    """Return as soon as ``condition()`` is true (a function, or one returning an awaitable); after ``timeout``
    seconds fail, naming ``what`` where given."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        met = condition()
        if inspect.isawaitable(met):
            met = await met
        if met:
            return
        if loop.time() >= deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(poll)
