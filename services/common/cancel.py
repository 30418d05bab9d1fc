"""Cancelling a task so that it ends, not merely once.

On Python 3.11 one ``Task.cancel()`` can be lost: ``asyncio.wait_for`` (which nats-py's ``next_msg`` and JetStream
fetches await) returns a result that arrived in the same loop turn as the cancellation and drops the cancellation,
so the task runs on as if never cancelled. A stage lane that went on fetching, or a trainer that went on after
losing its lease, would never end. Python 3.12 rewrote ``wait_for``; until then a task that must end is cancelled
again until it does.
"""

import asyncio

CANCEL_AGAIN_S = 0.2


async def cancel_until_done(*tasks: asyncio.Task, every_s: float = CANCEL_AGAIN_S) -> None:
    """Cancel ``tasks`` and return once every one has ended, cancelling those still running again every ``every_s``
    seconds. Their results and exceptions are left on the tasks for the caller; a task whose own clean-up may take
    a while should get an ``every_s`` longer than that clean-up, or a repeat interrupts it."""
    running = {task for task in tasks if not task.done()}
    while running:
        for task in running:
            task.cancel()
        _, running = await asyncio.wait(running, timeout=every_s)
