"""Publishing off the trainer's loop: a step does not wait for its version to be served, the next step goes on while
an offer is slow, and what rollouts pull for version N is the learner's weights after step N, not a later step's.

A real trainer (tiny learner, real nats-server) and its weight server on a real gRPC socket, pulled by the rollouts'
client. The server's publish waits for the test's go (``GatedServer``): an offer as slow as the test wants, without
a sleep."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.model.datasets import load_jsonl
from services.common.transport.bus import Bus
from services.common.transport.live_config import LiveConfig
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import Snapshot
from services.trainer.intake.reader import Collected
from services.trainer.learning.learner import Learner
from services.trainer.service import Trainer
from tests.support.runs import run_config
from tests.support.servers import create_run_state
from tests.support.trainer import experience
from tests.support.weights import serve_weights

pytestmark = pytest.mark.integration


class GatedServer(WeightSyncServer):
    """A weight server whose publish waits for one ``go`` per version: an offer as slow as the test holds it."""

    def __init__(self, initial: Snapshot):
        super().__init__(initial)
        self.go = asyncio.Semaphore(0)

    async def publish(self, snapshot: Snapshot) -> None:
        await self.go.acquire()
        await super().publish(snapshot)


async def served(weights: WeightSyncServer, version: int) -> None:
    while weights.latest.version < version:
        await asyncio.sleep(0.01)


def weights_now(learner: Learner) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in learner.model.state_dict().items()}


def test_a_slow_offer_holds_no_step_and_each_version_pulled_is_its_own_steps_weights(tiny_model, tmp_path, nats_url):
    _, data_dir = tiny_model
    cfg = run_config(tmp_path, tiny_model, nats={"url": nats_url}, data={"eval_path": None})
    groups = experience(cfg, load_jsonl(data_dir / "train.jsonl")[:4])

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "trainer").connect()
        live = await LiveConfig(cfg, bus.js).start()
        learner = Learner(cfg)
        weights = GatedServer(learner.snapshot(version=0, step=0))
        trainer = Trainer(cfg, bus, learner, weights, live)
        await trainer.prepare()
        server, address = await serve_weights(weights)
        client = WeightSyncClient(address)
        publisher = trainer.recovery.publisher
        try:
            await trainer.train_step(Collected(batch=groups, dropped=[], sequence=4))
            after_first = weights_now(learner)
            assert weights.latest.version == 0  # the step is over; its version is still being offered
            await trainer.train_step(Collected(batch=groups, dropped=[], sequence=8))
            after_second = weights_now(learner)
            assert trainer.progress.step == 2 and weights.latest.version == 0  # the slow offer held no step
            assert any(not torch.equal(after_first[name], after_second[name]) for name in after_first)

            weights.go.release()  # version 1's offer completes; version 2's waits behind it
            await asyncio.wait_for(served(weights, 1), timeout=30)
            version, pulled = await client.pull()
            assert version == 1 and set(pulled) >= set(after_first)
            for name, tensor in after_first.items():
                assert torch.equal(pulled[name], tensor), name  # step 1's weights, though step 2 changed them since

            weights.go.release()
            await publisher.drain()
            version, pulled = await client.pull()
            assert version == 2
            for name, tensor in after_second.items():
                assert torch.equal(pulled[name], tensor), name
        finally:
            await client.close()
            await server.stop(0)
            trainer.responder.metrics.close()
            await bus.close()

    asyncio.run(scenario())
