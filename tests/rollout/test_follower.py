"""A rollout whose trainer is away keeps the weights it holds instead of failing its batch."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.common.transport.weightsync.client import WeightSyncClient
from services.rollout.follower import PolicyFollower
from tests.support.relay_tree import model, trainer
from tests.support.servers import free_port

pytestmark = pytest.mark.integration


class RecordingEngine:
    def __init__(self):
        self.loads = 0

    def load_weights(self, tensors) -> None:
        self.loads += 1


def test_sync_with_the_trainer_down_keeps_the_loaded_version():
    async def scenario():
        engine = RecordingEngine()
        follower = PolicyFollower(
            engine, ThreadPoolExecutor(max_workers=1), WeightSyncClient(f"127.0.0.1:{free_port()}")
        )
        follower.loaded, follower.newest = 3, 4  # the trainer announced version 4, then died
        try:
            await follower.sync()  # nothing listens on the port: UNAVAILABLE
        finally:
            await follower.client.close()
        assert follower.loaded == 3 and engine.loads == 0

    asyncio.run(scenario())


def test_a_version_pulled_from_the_trainer_ahead_of_its_announcement_is_not_pulled_again_nor_undone():
    """The trainer serves its newest version (5) while the watch has only announced 4 (a relay's buffer for 4 broke
    and the follower fell back to the trainer): the follower takes 5 as the newest it knows, so the next batch's
    sync neither pulls the whole model again nor goes back to 4."""

    async def scenario():
        server, _, address = await trainer(model(5), fanout=0)
        engine = RecordingEngine()
        follower = PolicyFollower(engine, ThreadPoolExecutor(max_workers=1), WeightSyncClient(address))
        follower.loaded, follower.newest = 3, 4
        try:
            await follower.sync()
            assert (follower.loaded, follower.newest, engine.loads) == (5, 5, 1)
            await follower.sync()
            assert engine.loads == 1
        finally:
            await follower.client.close()
            await server.stop(0)

    asyncio.run(scenario())
