"""cancel_until_done ends a task that a single cancellation does not."""

import asyncio

import pytest

from services.common.cancel import cancel_until_done

pytestmark = pytest.mark.unit


def test_a_task_that_drops_two_cancellations_is_cancelled_until_it_ends_and_its_clean_up_runs():
    seen: list[str] = []

    async def stubborn() -> None:
        for _ in range(2):  # as asyncio.wait_for does on 3.11 when its result came in the same loop turn
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                seen.append("dropped")
        try:
            await asyncio.sleep(60)
        finally:
            seen.append("cleaned up")

    async def scenario() -> asyncio.Task:
        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_until_done(task, every_s=0.01), timeout=5)
        return task

    task = asyncio.run(scenario())
    assert task.cancelled()
    assert seen == ["dropped", "dropped", "cleaned up"]


def test_a_reader_whose_reply_lands_with_its_cancellation_still_ends():
    """The case that hung a trainer after it lost its lease: the cancellation lands in the turn a queued reply
    completes the reader's ``wait_for``, which on Python 3.11 hands the reply back and drops the cancellation (one
    ``cancel()`` here leaves the reader running; 3.12's ``wait_for`` no longer drops it)."""

    async def scenario() -> None:
        replies: asyncio.Queue[int] = asyncio.Queue()

        async def reader() -> None:
            while True:
                await asyncio.wait_for(replies.get(), timeout=60)

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)
        replies.put_nowait(1)  # answered in the same turn as the cancellation below
        await asyncio.wait_for(cancel_until_done(task, every_s=0.01), timeout=5)
        assert task.cancelled()

    asyncio.run(scenario())


def test_an_error_or_result_stays_on_the_task_for_the_caller():
    async def scenario() -> tuple[asyncio.Task, asyncio.Task]:
        async def fails() -> None:
            raise ValueError("broken")

        failed = asyncio.create_task(fails())
        finished = asyncio.create_task(asyncio.sleep(0, result="done"))
        await asyncio.sleep(0.01)
        await cancel_until_done(failed, finished)
        return failed, finished

    failed, finished = asyncio.run(scenario())
    assert isinstance(failed.exception(), ValueError)
    assert finished.result() == "done"
