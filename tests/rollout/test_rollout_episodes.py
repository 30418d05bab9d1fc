"""The rollout's multi-turn path against a real nats-server: an environment that fails on every
step ends each episode as env_error, and every group still goes on to ROLLOUTS; none is dead-lettered."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.common.episodes.environments import StepResult, Task, Turn
from services.common.episodes.generation import Generation
from services.common.transport.bus import Bus
from services.common.transport.messages import RolloutGroup, decode
from services.common.transport.streams import DEAD, ROLLOUTS, stream_name
from tests.support.bus import stream_messages
from tests.support.rollout import RUN_ID, FakeEngine, rollout_config, run_rollout

pytestmark = pytest.mark.integration


class BrokenTool:
    def reset(self, task: Task) -> str:
        return task.prompt

    def step(self, turn: Turn) -> StepResult:
        raise RuntimeError("the tool's own bug")


class TurnEngine(FakeEngine):
    """The outage test's engine, taking turns too: each a fixed tool call."""

    def __init__(self) -> None:
        super().__init__(fail=lambda text: None)
        self.tokenizer.eos_token_id = None
        self.tokenizer.decode = lambda ids, skip_special_tokens=True: "".join(map(chr, ids))

    def generate_turns(self, contexts, max_tokens, sampling, stop) -> list[Generation]:
        self.calls.append([f"{len(contexts)} turns"])
        ids = [ord(c) for c in "<calc>1</calc>"]
        return [Generation("<calc>1</calc>", np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), "stop")] * len(
            contexts
        )


def test_an_environment_that_fails_every_step_ends_episodes_as_env_error_and_dead_letters_no_group(
    tiny_model, tmp_path, nats_url, monkeypatch
):
    rollout = {
        "environment": f"{__name__}:BrokenTool",
        "turn_stop": ["</calc>"],
        # One batch in hand: with two, each lane may fetch one prompt and the engine calls below split in two.
        "episode_batches": 1,
    }
    cfg = rollout_config(tmp_path, tiny_model, nats_url, **rollout)
    engine = TurnEngine()

    async def scenario() -> list[RolloutGroup]:
        async def done(bus: Bus) -> bool:
            return await stream_messages(bus, ROLLOUTS) == 2

        bus = await run_rollout(cfg, engine, monkeypatch, done, timeout=60)
        assert await stream_messages(bus, DEAD) == 0
        stream = stream_name(RUN_ID, ROLLOUTS)
        groups = [decode((await bus.js.get_msg(stream, seq=seq)).data, RolloutGroup) for seq in (1, 2)]
        await bus.close()
        return groups

    groups = asyncio.run(scenario())
    assert sorted(group.prompt_id for group in groups) == ["also good", "good"]
    for group in groups:
        assert [c.episode.outcome for c in group.completions] == ["env_error", "env_error"]
        assert [c.episode.turns for c in group.completions] == [1, 1]
        assert [c.text for c in group.completions] == ["<calc>1</calc>", "<calc>1</calc>"]
    assert engine.calls == [["4 turns"]]  # one engine call for the batch's four episodes
