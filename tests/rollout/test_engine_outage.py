"""The rollout tells a failing engine from a bad prompt, against a real nats-server.

The rollout's own ``compute`` (built in ``services.rollout.service.main``) runs here over a
fake engine, the dependency that fails: an engine error (a dead engine core, a lost device)
becomes ``EngineUnavailable``, so the stage holds its prompts behind the circuit breaker
without spending a delivery and dead-letters nothing, while a prompt the engine rejects
(``ValueError``) still spends its deliveries and goes to DEAD.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

from services.common import service as common_service
from services.common.config import RunConfig, load_config
from services.common.episodes.generation import Generation
from services.common.transport.bus import Bus
from services.common.transport.messages import Prompt
from services.common.transport.streams import DEAD, PROMPTS, ROLLOUTS, WORK_QUEUES, stream_name
from services.rollout import service as rollout_service
from tests.support.runs import write_config
from tests.support.servers import create_run_state, free_port

pytestmark = pytest.mark.integration

RUN_ID = "engine"


class Tokenizer:
    """One token per character, so the engine can tell the prompts apart."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


class FakeEngine:
    """Generates one fixed completion per prompt, unless ``fail(prompt_text)`` raises."""

    lora_mode = "off"  # full weights, as the Engine protocol's other engines say at start
    end_tokens: frozenset[int] = frozenset()  # its completions are fixed: none ends on a token of its own

    def __init__(self, fail: Callable[[str], None]):
        self.tokenizer = Tokenizer()
        self.fail = fail
        self.calls: list[list[str]] = []

    def generate(self, prompt_ids: list[list[int]], sampling, max_seq_len: int) -> list[list[Generation]]:
        texts = ["".join(map(chr, ids)) for ids in prompt_ids]
        self.calls.append(texts)
        for text in texts:
            self.fail(text)
        completion = Generation("2", np.array([50], np.int32), np.zeros(1, np.float32), "stop")
        return [[completion] * sampling.group_size for _ in texts]

    def load_weights(self, tensors) -> None:
        for _ in tensors:
            pass


def config(tiny_model, tmp_path, nats_url) -> RunConfig:
    model_dir, data_dir = tiny_model
    path = write_config(
        tmp_path / "c.yaml",
        model_dir,
        data_dir,
        tmp_path / "runs",
        run_id=RUN_ID,
        sampling={"group_size": 2, "max_new_tokens": 4},
        nats={"url": nats_url, "ack_wait_s": 1, "heartbeat_s": 0.3, "max_deliver": 2, "fetch_timeout_s": 0.3},
        rollout={"prompts_per_batch": 2, "weight_relay": False},
        service={"trainer_grpc_port": free_port()},  # no trainer: the rollout keeps the weights it started with
    )
    return load_config(path)


async def run_rollout(cfg: RunConfig, engine: FakeEngine, monkeypatch, until: Callable, timeout: float) -> Bus:
    """The rollout's main over ``engine`` until ``until(bus)`` holds; returns a bus to look at the streams."""
    monkeypatch.setattr(rollout_service, "build_engine", lambda cfg: engine)
    # No metrics endpoint in this process (start_telemetry sets global providers once per process).
    no_telemetry = lambda: SimpleNamespace(metrics_url="")  # noqa: E731
    monkeypatch.setattr(rollout_service, "current_telemetry", no_telemetry)
    monkeypatch.setattr(common_service, "current_telemetry", no_telemetry)
    await create_run_state(cfg)
    bus = await Bus(cfg, "trainer").connect()
    for text in ("good", "also good"):
        prompt = Prompt(group_id=text.replace(" ", "-"), prompt_id=text, prompt=text, answer="2")
        await bus.publish(PROMPTS, prompt, msg_id=f"{prompt.group_id}.prompt")
    stop = asyncio.Event()
    rollout = asyncio.create_task(rollout_service.main(cfg, stop))
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        while not await until(bus):
            assert not rollout.done(), rollout.exception()
            assert asyncio.get_running_loop().time() < deadline, "timed out"
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(rollout, 30)
    return bus


async def messages(bus: Bus, edge: str) -> int:
    return (await bus.js.stream_info(stream_name(RUN_ID, edge))).state.messages


def events(caplog) -> list[dict]:
    return [getattr(r, "fields", {}) | {"event": r.getMessage()} for r in caplog.records]


def test_a_failing_engine_holds_the_prompts_without_spending_deliveries_or_dead_lettering(
    tiny_model, tmp_path, nats_url, monkeypatch, caplog
):
    cfg = config(tiny_model, tmp_path, nats_url)
    outage_s = 3 * cfg.nats.ack_wait_s * cfg.nats.max_deliver  # the old rule dead-lettered within ack_wait*max_deliver
    caplog.set_level(logging.INFO)
    seen: dict[str, object] = {}

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        bound_s = cfg.nats.ack_wait_s * cfg.nats.max_deliver
        first_failure: list[float] = []

        def fail(text: str) -> None:  # the engine is down for outage_s from its first call
            first_failure[:] = first_failure or [loop.time()]
            if loop.time() < first_failure[0] + outage_s:
                raise RuntimeError("engine core died")

        engine = FakeEngine(fail)

        async def done(bus: Bus) -> bool:
            if "mid" not in seen and first_failure and loop.time() > first_failure[0] + bound_s + 1:
                consumer = await bus.js.consumer_info(stream_name(RUN_ID, PROMPTS), WORK_QUEUES[PROMPTS])
                seen["mid"] = (consumer.num_ack_pending, consumer.num_redelivered, await messages(bus, DEAD))
            return await messages(bus, ROLLOUTS) == 2

        bus = await run_rollout(cfg, engine, monkeypatch, done, timeout=outage_s + 30)
        # Past ack_wait * max_deliver into the outage: both prompts held by the rollout, none redelivered.
        assert seen["mid"] == (2, 0, 0)
        assert await messages(bus, ROLLOUTS) == 2 and await messages(bus, DEAD) == 0
        assert len(engine.calls) >= 3  # retried behind the breaker, then generated once it answered
        assert engine.calls[-1] == ["good", "also good"]  # the batch whole: no prompt was blamed
        await bus.close()

    asyncio.run(scenario())
    logged = events(caplog)
    [down] = [e for e in logged if e["event"] == "dependency_down"]
    assert down["alert"] is True and down["step"] == "compute"
    assert "EngineUnavailable" in down["error"] and "engine core died" in down["error"]
    assert [e for e in logged if e["event"] == "dependency_recovered" and e.get("alert") is False]
    assert not [e for e in logged if e["event"] in ("dead_letter", "compute_failed", "batch_failed")]


def test_a_prompt_the_engine_rejects_still_goes_to_dead_letters(tiny_model, tmp_path, nats_url, monkeypatch, caplog):
    cfg = config(tiny_model, tmp_path, nats_url)
    caplog.set_level(logging.INFO)

    def fail(text: str) -> None:
        if text == "also good":
            raise ValueError("prompt longer than max_seq_len")  # the prompt's fault, not the engine's

    engine = FakeEngine(fail)

    async def scenario() -> None:
        async def done(bus: Bus) -> bool:
            return await messages(bus, DEAD) == 1

        bus = await run_rollout(cfg, engine, monkeypatch, done, timeout=60)
        assert await messages(bus, ROLLOUTS) == 1
        letter = await bus.js.get_msg(stream_name(RUN_ID, DEAD), seq=1)
        assert letter.headers["Rlpipe-Group-Id"] == "also-good"
        reason = letter.headers["Rlpipe-Reason"]
        assert f"failed {cfg.nats.max_deliver} times" in reason and "prompt longer than max_seq_len" in reason
        await bus.close()

    asyncio.run(scenario())
    assert not [e for e in events(caplog) if e["event"] in ("dependency_unavailable", "dependency_down")]
