"""The rollout role's own main over a fake engine, against a real broker: a run config for it, an engine that
answers every prompt with one fixed completion (or fails on demand), and the loop that runs the role until a
condition on the streams holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from services.common import service as common_service
from services.common.config import RunConfig
from services.common.episodes.generation import Generation
from services.common.transport.bus import Bus
from services.common.transport.streams import PROMPTS
from services.rollout import service as rollout_service
from tests.support.messages import prompt as make_prompt
from tests.support.runs import QUICK_REDELIVERY, run_config
from tests.support.servers import create_run_state, free_port

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
        prompt = make_prompt(text.replace(" ", "-"), prompt_id=text, prompt=text)
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


def rollout_config(tmp_path: Path, tiny_model: tuple[Path, Path], nats_url: str, **rollout) -> RunConfig:
    """A run of ``RUN_ID`` for one rollout over a ``FakeEngine``: groups of two, deliveries that time out in a
    second, and ``rollout`` over two prompts a batch without a relay."""
    return run_config(
        tmp_path,
        tiny_model,
        run_id=RUN_ID,
        sampling={"group_size": 2, "max_new_tokens": 4},
        nats={"url": nats_url, **QUICK_REDELIVERY},
        rollout={"prompts_per_batch": 2, "weight_relay": False, **rollout},
        service={"trainer_grpc_port": free_port()},  # no trainer: the rollout keeps the weights it started with
    )
