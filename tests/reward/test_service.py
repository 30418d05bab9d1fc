"""The reward service's main on a real nats-server, scoring through the reference reward server (a real process)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from services.common import service as common_service
from services.common.config import RunConfig, load_config
from services.common.transport.bus import Bus
from services.common.transport.messages import ScoredGroup
from services.common.transport.presence import read_presence
from services.common.transport.reader import StreamReader
from services.common.transport.streams import DEAD, ROLLOUTS, SCORED
from services.reward import service as reward_service
from tests.support.bus import stream_messages
from tests.support.messages import answered
from tests.support.servers import create_run_state, free_port, start_reward_server

pytestmark = pytest.mark.integration

RUN_ID = "authfix"
GROUPS = [answered("g1", "2", ["2", "3"]), answered("g2", "5", ["5", "x"]), answered("g3", "7", ["no", "7"])]


def events(caplog, name: str) -> list[dict]:
    return [getattr(r, "fields", {}) | {"level": r.levelname} for r in caplog.records if r.getMessage() == name]


def everything_logged(caplog) -> str:
    return "\n".join(json.dumps([r.getMessage(), getattr(r, "fields", {})], default=str) for r in caplog.records)


async def wait_until(condition, what: str, reward: asyncio.Task, timeout_s: float = 60) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():
        assert not reward.done(), reward.exception()
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def reward_config(tmp_path: Path, nats_url: str, port: int, token: str, **nats: float) -> RunConfig:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "token").write_text(token)
    config = {
        "run_id": RUN_ID,
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.jsonl")},
        "nats": {"url": nats_url, "fetch_timeout_s": 0.3, **nats},
        "reward": {
            "functions": {},
            "http": {"url": f"http://127.0.0.1:{port}/score", "token_file": str(tmp_path / "token"), "retries": 0},
        },
    }
    if "duplicate_window_s" in nats:  # past the default: groups still retried may not be written off as lost
        config["train"] = {"lost_after_s": 2 * nats["duplicate_window_s"]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    return load_config(tmp_path / "c.yaml")


@pytest.fixture
def no_telemetry(monkeypatch):
    """No metrics endpoint in this process (start_telemetry sets global providers once per process)."""
    stub = lambda: SimpleNamespace(metrics_url="")  # noqa: E731
    monkeypatch.setattr(reward_service, "current_telemetry", stub)
    monkeypatch.setattr(common_service, "current_telemetry", stub)


def test_a_refused_or_unsendable_token_holds_every_group_alerts_and_scores_them_once_the_file_is_rewritten(
    tmp_path, nats_url, caplog, no_telemetry
):
    """401 from the reference server, then a token file rotated to two lines, are the reward role's outage: nothing
    goes to DEAD (the old rules dead-lettered each group after max_deliver, within seconds here: the 401 at once,
    the two-line token as the header's ValueError, its text in the reason), each alerts at once naming its kind,
    no log line quotes the token, and rewriting the file with the right token lets the same groups through."""
    caplog.set_level(logging.INFO)
    port = free_port()
    server = start_reward_server(port, "--token", "right")
    # Short enough that an input fault would be dead-lettered well inside the waits below.
    cfg = reward_config(tmp_path, nats_url, port, "wrong\n", ack_wait_s=1, heartbeat_s=0.3, max_deliver=2)
    token_file = tmp_path / "token"

    async def scenario() -> list[ScoredGroup]:
        await create_run_state(cfg)
        bus = await Bus(cfg, "trainer").connect()
        for one in GROUPS:
            await bus.publish(ROLLOUTS, one, msg_id=f"{one.group_id}.rollout")
        stop = asyncio.Event()
        reward = asyncio.create_task(reward_service.main(cfg, stop))
        retrying_s = cfg.nats.ack_wait_s * cfg.nats.max_deliver

        async def refused(kind: str) -> bool:
            return any(e.get("kind") == kind for e in events(caplog, "reward_request_failed"))

        try:
            await wait_until(lambda: refused("http_401"), "the 401", reward)
            # Fixed waits, past the delivery budget, since what they show is that nothing happens: held, not
            # dead-lettered.
            await asyncio.sleep(4 * retrying_s)
            assert (await stream_messages(bus, DEAD), await stream_messages(bus, SCORED)) == (0, 0)

            token_file.write_text("right\nLEAKED-second-line\n")  # a rotation gone wrong
            await wait_until(lambda: refused("token"), "the unsendable token", reward)
            await asyncio.sleep(4 * retrying_s)
            assert (await stream_messages(bus, DEAD), await stream_messages(bus, SCORED)) == (0, 0)

            token_file.write_text("right\n")

            async def all_scored() -> bool:
                return await stream_messages(bus, SCORED) == len(GROUPS)

            await wait_until(all_scored, "the rewritten token to let the groups through", reward)
            assert await stream_messages(bus, DEAD) == 0
            reader = StreamReader(bus, SCORED, 1)
            return [await bus.decode(await reader.next(5), ScoredGroup) for _ in GROUPS]
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
    [stage_down] = events(caplog, "dependency_down")  # the stage's alert, at the first refusal
    assert (stage_down["level"], stage_down["kind"], stage_down["refused"]) == ("ERROR", "http_401", True)
    assert len(events(caplog, "reward_service_recovered")) == 1
    assert events(caplog, "dead_letter") == []
    assert "LEAKED" not in everything_logged(caplog)


def test_a_refused_token_alerts_at_once_and_tells_the_trainer_through_presence_not_after_the_redelivery_bound(
    tmp_path, nats_url, caplog, no_telemetry
):
    """ack_wait_s x max_deliver is 25 minutes here: a 401 used to raise dependency_down only after it, as if a
    wrong token were a passing outage. Now the stage's alert and its presence entry's refusal come within the
    first tries (the wait below is a bound far under the redelivery bound, not a speed target)."""
    caplog.set_level(logging.INFO)
    port = free_port()
    server = start_reward_server(port, "--token", "right")
    cfg = reward_config(
        tmp_path, nats_url, port, "wrong\n", ack_wait_s=300, max_deliver=5, heartbeat_s=10, duplicate_window_s=3600
    )
    assert cfg.nats.ack_wait_s * cfg.nats.max_deliver == 1500

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "trainer").connect()
        await bus.publish(ROLLOUTS, GROUPS[0], msg_id="g1.rollout")
        stop = asyncio.Event()
        reward = asyncio.create_task(reward_service.main(cfg, stop))

        async def alerted() -> bool:
            return bool(events(caplog, "dependency_down"))

        async def presence_says_refused() -> bool:
            return any(
                entry.role == "reward" and entry.refused for entry in await read_presence(bus.js, cfg.run_id, cfg.nats)
            )

        try:
            await wait_until(alerted, "dependency_down", reward, timeout_s=120)
            await wait_until(presence_says_refused, "the refusal in the reward's presence entry", reward, 120)
            [entry] = [entry for entry in await read_presence(bus.js, cfg.run_id, cfg.nats) if entry.role == "reward"]
            assert (entry.refused.kind, entry.refused.step) == ("http_401", "compute")
            assert "HTTP 401" in entry.refused.error
            assert await stream_messages(bus, DEAD) == 0
        finally:
            stop.set()
            await asyncio.wait_for(reward, 30)
            await bus.close()

    try:
        asyncio.run(scenario())
    finally:
        server.kill()
        server.wait()
    [down] = events(caplog, "dependency_down")
    assert (down["level"], down["alert"], down["kind"], down["refused"]) == ("ERROR", True, "http_401", True)
    assert down["down_s"] < cfg.nats.ack_wait_s
