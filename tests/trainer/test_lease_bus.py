"""One trainer per run, on a real nats-server: the lease refuses a second trainer, and a holder paused past its
lease (SIGSTOP) that wakes after a successor took over stops without writing anything to the checkpoint store."""

import asyncio
import logging
import os
import signal
import time

import nats
import pytest

from services.common.cancel import cancel_until_done
from services.common.config import CheckpointConfig, load_config
from services.common.refusal import StartRefused
from services.common.service import EXIT_REFUSED
from services.common.transport.lease_bucket import open_bucket
from services.common.transport.storage import open_store
from services.trainer.checkpointing.step_store import FencedOut
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.lease import Lease, LeaseLost
from tests.support.runs import config_file
from tests.support.trainer import TrainerProcess, checkpoint, stored_objects

pytestmark = pytest.mark.integration

TTL_S = 3.0


def test_a_second_lease_is_refused_while_the_first_is_renewed_and_taken_at_a_higher_epoch_once_it_lapses(
    nats_url, tmp_path
):
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    url = f"file://{tmp_path / 'store'}"

    async def scenario() -> None:
        connection = await nats.connect(nats_url)
        kv = await open_bucket(connection.jetstream(), "r1", "file", 1)
        first, second = Lease(kv, "r1", TTL_S), Lease(kv, "r1", TTL_S)
        second.holder = "other-host:2"
        assert await first.acquire() == 1
        stale = CheckpointStore(open_store(url, CheckpointConfig()), "r1", keep_last=1)
        stale.claim_fence(first.epoch, first.holder)
        incarnation = stale.start_fresh()
        stale.save(checkpoint(1, incarnation), model_dir)
        lost_by_keeper: list[LeaseLost] = []

        async def on_lost(error: LeaseLost) -> None:
            lost_by_keeper.append(error)

        keeper = asyncio.create_task(first.keep(on_lost))  # a live holder: renewed every third of the TTL
        with pytest.raises(StartRefused, match=rf"run r1 already has a live trainer: {first.holder} holds its lease"):
            await second.acquire()
        assert second.record is None

        # The holder stops renewing (paused, or killed): its lease lapses and is taken then.
        await cancel_until_done(keeper)
        assert await second.acquire(floor=stale.stored_fence()) == 2
        assert lost_by_keeper == []
        successor = CheckpointStore(open_store(url, CheckpointConfig()), "r1", keep_last=1, incarnation=incarnation)
        successor.claim_fence(second.epoch, second.holder)
        before = stored_objects(stale)

        with pytest.raises(LeaseLost, match="another trainer took over the lease from epoch 1: other-host:2") as lost:
            await first.renew()
        assert lost.value.taken_over is True
        with pytest.raises(FencedOut, match="epoch 2"):
            stale.save(checkpoint(2, incarnation), model_dir)
        assert stored_objects(stale) == before
        await second.renew()  # the successor's lease is untouched by the stale holder's attempts
        await connection.close()

    asyncio.run(scenario())


def test_a_lease_run_out_unrenewed_that_nobody_took_is_taken_back_at_its_epoch_and_refuses_writes_meanwhile(
    nats_url, caplog
):
    async def scenario() -> None:
        connection = await nats.connect(nats_url)
        kv = await open_bucket(connection.jetstream(), "r1", "file", 1)
        holder = Lease(kv, "r1", TTL_S)
        assert await holder.acquire() == 1
        lost: list[LeaseLost] = []

        async def on_lost(error: LeaseLost) -> None:
            lost.append(error)

        keeper = asyncio.create_task(holder.keep(on_lost))
        await asyncio.sleep(0)  # the keeper is waiting for its first renewal
        time.sleep(TTL_S + 0.5)  # the loop blocked past the lease (a slow broker or a loaded machine does the same)
        with pytest.raises(LeaseLost, match="expired"):
            holder.check()  # out by its own clock: the store's writes are refused
        deadline = time.monotonic() + 10 * TTL_S
        while holder.lapsed_s() > 0:
            assert time.monotonic() < deadline, "the lapsed lease was never taken back"
            await asyncio.sleep(0.1)
        holder.check()  # held again: writes go on
        assert (holder.epoch, lost) == (1, [])
        latecomer = Lease(kv, "r1", TTL_S)
        latecomer.holder = "other-host:2"
        with pytest.raises(StartRefused, match="holds its lease"):
            await latecomer.acquire()  # renewed again by its keeper: a live holder
        await cancel_until_done(keeper)
        await connection.close()

    caplog.set_level(logging.INFO, logger="services.trainer.lease")
    asyncio.run(scenario())
    [reclaimed] = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "lease_reclaimed"]
    assert reclaimed["epoch"] == 1 and reclaimed["lapsed_s"] > 0


def test_a_renewal_whose_reply_was_lost_after_it_landed_is_not_mistaken_for_a_takeover_and_a_successor_is(
    nats_url,
):
    class LostReplies:
        """The real bucket, whose next update lands but answers with a timeout (a reply lost on a loaded broker)."""

        def __init__(self, kv):
            self.kv = kv
            self.lose_next = False

        async def get(self, key):
            return await self.kv.get(key)

        async def create(self, key, value):
            return await self.kv.create(key, value)

        async def update(self, key, value, last):
            revision = await self.kv.update(key, value, last=last)
            if self.lose_next:
                self.lose_next = False
                raise TimeoutError("nats: timeout")
            return revision

    async def scenario() -> None:
        connection = await nats.connect(nats_url)
        real = await open_bucket(connection.jetstream(), "r1", "file", 1)
        kv = LostReplies(real)
        holder = Lease(kv, "r1", TTL_S)
        assert await holder.acquire() == 1
        kv.lose_next = True
        with pytest.raises(TimeoutError):
            await holder.renew()
        await holder.renew()  # the landed write is this holder's own: renewed on top of it
        holder.check()
        # A successor on the same host:pid (pid 1 in a container restarted in place) is still a successor.
        twin = Lease(real, "r1", TTL_S, reaped_holder=holder.holder)
        assert await twin.acquire() == 2
        with pytest.raises(LeaseLost, match="took over the lease from epoch 1") as lost:
            await holder.renew()
        assert lost.value.taken_over is True
        await connection.close()

    asyncio.run(scenario())


def test_a_restarted_trainer_takes_its_reaped_predecessor_s_lease_at_once_at_a_higher_epoch(nats_url):
    long_ttl_s = 600.0  # far longer than the test may take: only the takeover can end the wait

    async def scenario() -> None:
        connection = await nats.connect(nats_url)
        kv = await open_bucket(connection.jetstream(), "r1", "file", 1)
        killed = Lease(kv, "r1", long_ttl_s)
        assert await killed.acquire() == 1
        restarted = Lease(kv, "r1", long_ttl_s, reaped_holder=killed.holder)
        restarted.holder = "host:restarted"
        assert await asyncio.wait_for(restarted.acquire(), timeout=long_ttl_s / 10) == 2
        with pytest.raises(LeaseLost, match="another trainer took over") as lost:
            await killed.renew()  # had it lived after all, its next renewal finds the lease gone
        assert lost.value.taken_over is True
        await connection.close()

    asyncio.run(scenario())


def test_a_second_trainer_is_refused_and_a_sigstopped_holder_woken_after_a_takeover_stops_writing_nothing(
    tiny_model, tmp_path, nats_url
):
    # The checkpoint store apart from the run directory, where both trainers (on one machine) log their metrics.
    stored = {"store_url": f"file://{tmp_path / 'store'}"}
    config = config_file(tmp_path, tiny_model, trainer={"lease_ttl_s": TTL_S}, checkpoint=stored)
    cfg = load_config(config)
    store = CheckpointStore(open_store(cfg.checkpoint_url, cfg.checkpoint), cfg.run_id, cfg.checkpoint.keep_last)
    holder = TrainerProcess(config, nats_url)
    started = []
    try:
        holder.wait_event("ready")
        assert holder.event("lease_acquired")["epoch"] == 1

        second = TrainerProcess(config, nats_url)
        started.append(second)
        assert second.wait_exit() == EXIT_REFUSED
        refusal = second.event("start_refused")["error"]
        assert f":{holder.process.pid} holds its lease (epoch 1, expires in" in refusal
        assert second.event("lease_acquired") is None
        assert store.stored_fence() == 1  # the refused trainer claimed nothing

        os.kill(holder.process.pid, signal.SIGSTOP)
        time.sleep(TTL_S + 1.0)  # past its lease: it cannot renew while stopped
        successor = TrainerProcess(config, nats_url)
        started.append(successor)
        successor.wait_event("ready")
        assert successor.event("lease_acquired")["epoch"] == 2
        assert store.stored_fence() == 2
        before = stored_objects(store)

        os.kill(holder.process.pid, signal.SIGCONT)
        assert holder.wait_exit() == EXIT_REFUSED  # taken over: a supervisor must not restart it
        lost = holder.event("lease_lost")
        assert (lost["epoch"], lost["taken_over"]) == (1, True)
        assert stored_objects(store) == before  # not one object written, replaced or deleted by the woken holder
        assert successor.process.poll() is None
    finally:
        for trainer in [holder, *started]:
            if trainer.process.poll() is None:
                os.kill(trainer.process.pid, signal.SIGCONT)
                trainer.process.kill()
                trainer.process.wait(timeout=30)
