"""Nothing long runs on the loop that keeps the trainer's lease: a checkpoint snapshot that takes twice the lease's
TTL keeps the lease, and the save completes under it.

A real trainer (tiny learner, real nats-server, its file store fenced by the lease as ``role.lead`` wires it) and the
real ``Lease`` renewed by its keeper on the trainer's loop, with a short TTL. The learner's state copy is slowed by
a sleep on the thread that makes it, as a full save of a larger model on a loaded machine is (28.9 s measured for
SmolLM2-135M, against a 15 s TTL): run on the loop, that sleep would starve the keeper and the lease would lapse."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from services.common.model.datasets import load_jsonl
from services.common.transport.lease_bucket import open_bucket
from services.trainer.intake.reader import Collected
from services.trainer.lease import Lease, LeaseLost
from tests.support.runs import run_config
from tests.support.trainer import experience, start_trainer

pytestmark = pytest.mark.integration

TTL_S = 1.5  # renewed every 0.5 s


def test_a_snapshot_twice_the_lease_ttl_keeps_the_lease_and_the_save_completes(tiny_model, tmp_path, nats_url):
    _, data_dir = tiny_model
    cfg = run_config(tmp_path, tiny_model, nats={"url": nats_url}, data={"eval_path": None})
    groups = experience(cfg, load_jsonl(data_dir / "train.jsonl")[:4])

    async def scenario() -> None:
        trainer = await start_trainer(cfg)
        kv = await open_bucket(trainer.bus.js, cfg.run_id, "file", 1)
        lease = Lease(kv, cfg.run_id, TTL_S)
        await lease.acquire(await asyncio.to_thread(trainer.checkpoints.stored_fence))
        await asyncio.to_thread(trainer.checkpoints.claim_fence, lease.epoch, lease.holder)
        trainer.checkpoints.guard = lease.check  # every write of the save checks the lease is still held
        lost: list[LeaseLost] = []

        async def on_lost(error: LeaseLost) -> None:
            lost.append(error)

        keeper = asyncio.create_task(lease.keep(on_lost))
        state = trainer.learner.state

        def slow_state(optimizer: bool = True):
            time.sleep(2 * TTL_S)  # the injected slowness: what a long host copy costs
            return state(optimizer=optimizer)

        trainer.learner.state = slow_state
        try:
            await trainer.train_step(Collected(batch=groups, dropped=[], sequence=4))
            await trainer.save(wait=True)
            assert lost == []
            lease.check()  # still held by this trainer's own clock
            assert trainer.progress.saved_step == 1
            assert await asyncio.to_thread(trainer.checkpoints.steps) == [1]
            await asyncio.to_thread(trainer.responder.metrics.flush)
            rows = [json.loads(line) for line in cfg.metrics_file.read_text().splitlines()]
            [saved] = [row for row in rows if row.get("checkpoint_saved")]
            assert saved["checkpoint_stall_s"] >= 2 * TTL_S  # the step did wait out the slow snapshot
        finally:
            keeper.cancel()
            trainer.responder.metrics.close()
            await trainer.bus.close()

    asyncio.run(scenario())
