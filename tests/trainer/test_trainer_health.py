"""The trainer's gRPC health follows its loop: NOT_SERVING while the loop is stuck, SERVING once it moves again,
and SERVING through an idle pipeline and an operator's pause.

A real trainer loop (tiny learner, real nats-server, both real gRPC servers, checked by the healthcheck client
probes use); the loop is blocked by a queued command that does not return, as a learner step that hangs would.
"""

from __future__ import annotations

import asyncio

import pytest

from services.cli.healthcheck import check
from services.common.config import ConfigError, load_config
from services.common.pb import weights_pb2_grpc
from services.common.service import start_grpc_server, watch_progress
from services.common.transport.presence import Presence
from services.trainer.admin import AdminServicer
from services.trainer.liveness import LoopHeartbeat
from services.trainer.role import start_admin_server
from tests.support.runs import config_file
from tests.support.trainer import start_trainer, trainer_config

pytestmark = pytest.mark.integration

# Shrunk from train.stall_bound_s (at least 60 s in a config) so the test need not wait minutes.
BOUND_S = 3.0


async def _health(addresses: list[str]) -> list[str | None]:
    return [await asyncio.to_thread(check, address) for address in addresses]


async def _until(addresses: list[str], wanted: list[str | None], timeout_s: float = 30.0) -> list[str | None]:
    """The health of ``addresses`` once it is ``wanted``, or as it stands when ``timeout_s`` ran out."""
    for _ in range(int(timeout_s / 0.2)):
        seen = await _health(addresses)
        if seen == wanted:
            break
        await asyncio.sleep(0.2)
    return seen


def test_the_trainer_reports_not_serving_while_its_loop_is_stuck_and_serving_when_idle_or_paused(
    tiny_model, tmp_path, nats_url, monkeypatch
):
    monkeypatch.setenv("RLPIPE_ADMIN_TOKEN", "s3cret")
    cfg = trainer_config(tmp_path, tiny_model, nats_url)

    async def scenario() -> None:
        trainer = await start_trainer(cfg)
        trainer.heartbeat.bound_s = BOUND_S

        def register(server):
            weights_pb2_grpc.add_WeightSyncServicer_to_server(trainer.recovery.weights, server)
            return ["rlpipe.v1.WeightSync"]

        server, address = await start_grpc_server(cfg, 0, register)
        admin_server, admin_address = await start_admin_server(
            cfg, AdminServicer(trainer.control, trainer.status, trainer.live, trainer.recovery)
        )
        presence = await Presence(trainer.bus.js, cfg, "trainer", trainer.live).start(grpc=address, admin=admin_address)
        watchdog = asyncio.create_task(watch_progress(trainer.heartbeat, [server, admin_server], presence))
        stop = asyncio.Event()
        loop = asyncio.create_task(trainer.run(stop))
        addresses = [address, admin_address]
        try:
            # No rollout runs: the loop waits for groups, beating, for well past the bound.
            await asyncio.sleep(3 * BOUND_S)
            assert await _health(addresses) == [None, None]

            release = asyncio.Event()
            trainer.control.submit(release.wait)  # the loop runs it between steps and hangs there
            stuck = [f"{address}: NOT_SERVING", f"{admin_address}: NOT_SERVING"]
            assert await _until(addresses, stuck) == stuck
            assert not loop.done()

            release.set()  # the loop moves on: healthy again at its next beat
            assert await _until(addresses, [None, None]) == [None, None]

            await trainer.control.pause("operator pause")  # held: the loop goes round every second, beating
            await asyncio.sleep(3 * BOUND_S)
            assert await _health(addresses) == [None, None]
            assert trainer.progress.step == 0  # no step was taken: only the loop's beats kept it healthy
        finally:
            stop.set()
            await asyncio.wait_for(loop, timeout=60)
            watchdog.cancel()
            await presence.stop()
            await admin_server.stop(grace=0)
            await server.stop(grace=0)
            await trainer.bus.close()

    asyncio.run(scenario())


@pytest.mark.unit
def test_the_heartbeat_counts_stalled_seconds_only_past_its_bound():
    heartbeat = LoopHeartbeat(bound_s=60.0, last_progress=1000.0)
    assert heartbeat.stalled_for(1059.0) == 0.0
    assert heartbeat.stalled_for(1070.0) == 10.0
    heartbeat.beat()
    assert heartbeat.stalled_for(heartbeat.last_progress + 1.0) == 0.0


def test_a_stall_bound_below_a_minute_is_refused_naming_the_field(tiny_model, tmp_path):
    config = config_file(tmp_path, tiny_model, train={"stall_bound_s": 5})
    with pytest.raises(ConfigError, match=r"train\.stall_bound_s"):
        load_config(config)
