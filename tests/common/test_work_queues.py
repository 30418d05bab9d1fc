"""Which groups the work queues still hold for delivery, against a real nats-server."""

import asyncio
import time

import pytest

from services.common.config import NatsConfig
from services.common.transport.bus import Bus
from services.common.transport.streams import H_GROUP, PROMPTS, ROLLOUTS
from services.common.transport.work_queues import groups_queued, redelivery_horizon_s
from tests.support.messages import prompt, rollout_group
from tests.support.runs import run_config
from tests.support.servers import create_run_state

pytestmark = pytest.mark.integration


def test_undelivered_and_recently_delivered_messages_hold_their_groups_acked_and_spent_ones_do_not(
    tiny_model, tmp_path, nats_url
):
    cfg = run_config(tmp_path, tiny_model, run_id="queued", nats={"url": nats_url, "ack_wait_s": 30, "max_deliver": 2})

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "rollout").connect()
        for group in ("taken-and-acked", "taken-and-held", "waiting"):
            await bus.publish(PROMPTS, prompt(group, incarnation="this"), msg_id=f"{group}.p")
        await bus.publish(PROMPTS, prompt("an-older-incarnations", incarnation="old"), msg_id="old.p")
        await bus.publish(ROLLOUTS, rollout_group(group_id="scored-next", incarnation="this"), msg_id="s.r")
        queue = await bus.work_queue(PROMPTS)
        acked, held = await queue.fetch(2, timeout=5)
        await acked.ack()  # done: the rollout published its output first
        assert acked.headers and held.headers and held.headers[H_GROUP] == "taken-and-held"

        queued = await groups_queued(bus.js, cfg.run_id, cfg.nats, "this")
        assert queued == {"taken-and-held", "waiting", "scored-next"}
        # Past the horizon a delivered message's deliveries are spent; one never delivered still waits for a
        # replica, however long (the ROLLOUTS queue has no consumer yet: nothing there was delivered).
        later = time.time() + redelivery_horizon_s(cfg.nats) + 1
        assert await groups_queued(bus.js, cfg.run_id, cfg.nats, "this", now=later) == {"waiting", "scored-next"}
        # More messages than the scan reads is a backlog: nothing can be told lost then.
        assert await groups_queued(bus.js, cfg.run_id, cfg.nats, "this", limit=3) is None
        await bus.close()

    asyncio.run(scenario())


@pytest.mark.unit
def test_the_horizon_covers_every_delivery_a_stage_may_make_of_one_message():
    nats = NatsConfig(max_work_s=100, ack_wait_s=60, max_deliver=4)
    # max_deliver + 1 deliveries (the last dead-letters it), each up to max_work_s of compute, then a nak's backoff.
    assert redelivery_horizon_s(nats) == 5 * (100 + 30)
