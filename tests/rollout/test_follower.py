"""A rollout whose trainer is away keeps the weights it holds instead of failing its batch."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.common.transport.weightsync.client import WeightSyncClient
from services.rollout.follower import PolicyFollower
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
