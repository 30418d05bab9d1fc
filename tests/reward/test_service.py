"""The reward service's main on a real nats-server, scoring through the reference reward server (a real process)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
import yaml

from services.common import service as common_service
from services.common.config import load_config
from services.common.transport.bus import Bus
from services.common.transport.live_config import LiveConfig
from services.common.transport.messages import ScoredGroup
from services.common.transport.reader import StreamReader
from services.common.transport.streams import DEAD, ROLLOUTS, SCORED, stream_name
from services.reward import service as reward_service
from tests.conftest import create_run_state, free_port
from tests.reward.test_remote import start_server
from tests.reward.test_scoring import group

pytestmark = pytest.mark.integration

RUN_ID = "authfix"


def events(caplog, name: str) -> list[dict]:
    return [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == name]


async def count(bus: Bus, edge: str) -> int:
    return (await bus.js.stream_info(stream_name(RUN_ID, edge))).state.messages


def test_a_refused_token_holds_every_group_alerts_and_scores_them_once_the_token_is_fixed_live(
    tmp_path, nats_url, monkeypatch, caplog
):
    """401 from the reference server is the reward role's outage: nothing goes to DEAD (the old rule dead-lettered
    each group after max_deliver, within seconds here), reward_service_down names the status, and pointing
    reward.http.token_file at the right token through live config lets the same groups through."""
    caplog.set_level(logging.INFO)
    port = free_port()
    server = start_server(port, "--token", "right")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "expired").write_text("wrong\n")
    (tmp_path / "rotated").write_text("right\n")
    config = {
        "run_id": RUN_ID,
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.jsonl")},
        # Short enough that an input fault would be dead-lettered well inside the wait below.
        "nats": {"url": nats_url, "ack_wait_s": 1, "heartbeat_s": 0.3, "max_deliver": 2, "fetch_timeout_s": 0.3},
        "reward": {
            "functions": {},
            "http": {
                "url": f"http://127.0.0.1:{port}/score",
                "token_file": str(tmp_path / "expired"),
                "retries": 0,
                "timeout_s": 5,
            },
        },
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    cfg = load_config(tmp_path / "c.yaml")
    # No metrics endpoint in this process (start_telemetry sets global providers once per process).
    no_telemetry = lambda: SimpleNamespace(metrics_url="")  # noqa: E731
    monkeypatch.setattr(reward_service, "current_telemetry", no_telemetry)
    monkeypatch.setattr(common_service, "current_telemetry", no_telemetry)
    groups = [group("g1", "2", ["2", "3"]), group("g2", "5", ["5", "x"]), group("g3", "7", ["no", "7"])]

    async def scenario() -> list[ScoredGroup]:
        await create_run_state(cfg)
        bus = await Bus(cfg, "trainer").connect()
        for one in groups:
            await bus.publish(ROLLOUTS, one, msg_id=f"{one.group_id}.rollout")
        stop = asyncio.Event()
        reward = asyncio.create_task(reward_service.main(cfg, stop))
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while not events(caplog, "reward_service_down"):
                assert not reward.done(), reward.exception()
                assert loop.time() < deadline, "no reward_service_down alert"
                await asyncio.sleep(0.1)
            await asyncio.sleep(4 * cfg.nats.ack_wait_s * cfg.nats.max_deliver)
            assert (await count(bus, DEAD), await count(bus, SCORED)) == (0, 0)

            live = await LiveConfig(cfg, bus.js).start()
            await live.propose({"reward.http.token_file": str(tmp_path / "rotated")}, author="operator")
            deadline = loop.time() + 60
            while await count(bus, SCORED) < len(groups):
                assert not reward.done(), reward.exception()
                assert loop.time() < deadline, "the fixed token never let the groups through"
                await asyncio.sleep(0.2)
            assert await count(bus, DEAD) == 0
            reader = StreamReader(bus, SCORED, 1)
            return [await bus.decode(await reader.next(5), ScoredGroup) for _ in groups]
        finally:
            stop.set()
            await asyncio.wait_for(reward, 30)
            await bus.close()

    try:
        scored = asyncio.run(scenario())
    finally:
        server.kill()
        server.wait()
    assert {one.group_id: one.rewards.tolist() for one in scored} == {
        "g1": [1.0, 0.0],
        "g2": [1.0, 0.0],
        "g3": [0.0, 1.0],
    }
    [down] = events(caplog, "reward_service_down")
    assert down["alert"] is True and down["kind"] == "http_401" and "HTTP 401" in down["error"]
    assert len(events(caplog, "reward_service_recovered")) == 1
    assert events(caplog, "dead_letter") == []
