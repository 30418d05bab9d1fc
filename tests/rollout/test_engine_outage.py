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

import pytest

from services.common.transport.bus import Bus
from services.common.transport.streams import DEAD, PROMPTS, ROLLOUTS, WORK_QUEUES, stream_name
from tests.support.bus import stream_messages
from tests.support.rollout import RUN_ID, FakeEngine, rollout_config, run_rollout

pytestmark = pytest.mark.integration


def events(caplog) -> list[dict]:
    return [getattr(r, "fields", {}) | {"event": r.getMessage()} for r in caplog.records]


def test_a_failing_engine_holds_the_prompts_without_spending_deliveries_or_dead_lettering(
    tiny_model, tmp_path, nats_url, monkeypatch, caplog
):
    cfg = rollout_config(tmp_path, tiny_model, nats_url)
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
                seen["mid"] = (consumer.num_ack_pending, consumer.num_redelivered, await stream_messages(bus, DEAD))
            return await stream_messages(bus, ROLLOUTS) == 2

        bus = await run_rollout(cfg, engine, monkeypatch, done, timeout=outage_s + 30)
        # Past ack_wait * max_deliver into the outage: both prompts held by the rollout, none redelivered.
        assert seen["mid"] == (2, 0, 0)
        assert await stream_messages(bus, ROLLOUTS) == 2 and await stream_messages(bus, DEAD) == 0
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
    cfg = rollout_config(tmp_path, tiny_model, nats_url)
    caplog.set_level(logging.INFO)

    def fail(text: str) -> None:
        if text == "also good":
            raise ValueError("prompt longer than max_seq_len")  # the prompt's fault, not the engine's

    engine = FakeEngine(fail)

    async def scenario() -> None:
        async def done(bus: Bus) -> bool:
            return await stream_messages(bus, DEAD) == 1

        bus = await run_rollout(cfg, engine, monkeypatch, done, timeout=60)
        assert await stream_messages(bus, ROLLOUTS) == 1
        letter = await bus.js.get_msg(stream_name(RUN_ID, DEAD), seq=1)
        assert letter.headers["Rlpipe-Group-Id"] == "also-good"
        reason = letter.headers["Rlpipe-Reason"]
        assert f"failed {cfg.nats.max_deliver} times" in reason and "prompt longer than max_seq_len" in reason
        await bus.close()

    asyncio.run(scenario())
    assert not [e for e in events(caplog) if e["event"] in ("dependency_unavailable", "dependency_down")]
