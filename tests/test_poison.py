"""A flood of malformed messages into every stream while a run goes on: all dead-lettered, nothing crashes.

Counts are exact: DEAD deduplicates on ``<edge>.<origin sequence>.dead``, so a message handled twice
(a trainer re-reading EXPERIENCE, a redelivery) still has one dead letter, and a healthy group that
landed there would be a bug, not noise.

The rollouts generate with transformers (``rollout.backend: hf``): the engine is not what is under test here.
"""

from __future__ import annotations

import asyncio
import json

import msgpack
import nats
import numpy as np
import pytest

from services.cli.dead_letters import list_dead_letters, operator_options
from services.common.transport.messages import encode
from services.common.transport.streams import stream_name, subject
from tests.support.messages import completion, scored_group
from tests.support.runs import config_file, metric_rows, rlpipe, run_info, running_pipeline, wait_for

# Whole pipelines, minutes each: the slow tier (make test runs it after the rest).
pytestmark = pytest.mark.e2e

EDGES = ("prompts", "rollouts", "scored", "experience")
PER_KIND = 50  # 5 kinds x 4 edges x 50 = 1,000 messages
# What each edge's consumer decodes its input as.
KINDS = {"prompts": "Prompt", "rollouts": "RolloutGroup", "scored": "ScoredGroup", "experience": "ExperienceGroup"}


def nan_rewards_group() -> bytes:
    answer = completion(np.array([5, 1], np.int32), text="2", logprobs=np.array([-0.1, -0.2], np.float32))
    group = scored_group("nan", [0.0], completions=[answer], prompt_ids=[3], prompt_id="p")
    raw = msgpack.unpackb(encode(group))
    raw["rewards"]["data"] = np.array([np.nan], "<f4").tobytes()
    return msgpack.packb(raw)


def bad_messages() -> dict[str, bytes]:
    return {
        "garbage": b"\x93\xff\x00not a message",
        "schema": msgpack.packb({"v": 7, "kind": "prompt", "group_id": "g"}),
        "missing": msgpack.packb({"v": 1, "kind": "rollout", "group_id": "g"}),
        "nan": nan_rewards_group(),
        "oversized": msgpack.packb({"v": 1, "kind": "prompt", "pad": b"x" * (600 * 1024)}),
    }


def expected_reason(kind: str, edge: str) -> str:
    """The part of the DEAD reason that says why a message of ``kind`` was refused on ``edge``."""
    if kind == "nan" and edge == "scored":
        return "rewards contain NaN"  # a valid ScoredGroup but for its rewards
    return {
        "garbage": "not msgpack",
        "schema": "schema version 7 is not supported",
        "missing": f"invalid {KINDS[edge]}",
        "nan": f"invalid {KINDS[edge]}",  # a ScoredGroup where another kind is expected
        "oversized": "exceeds nats.max_message_bytes",
    }[kind]


async def flood(nats_url: str, run_id: str, options: dict) -> dict[tuple[str, int], tuple[str, str]]:
    """Publish the bad messages; returns (stream, sequence) -> (edge, kind) of each, from its publish ack."""
    nc = await nats.connect(nats_url, **options)
    js = nc.jetstream()
    sent = {}
    for _ in range(PER_KIND):
        for edge in EDGES:
            for kind, payload in bad_messages().items():
                ack = await js.publish(subject(run_id, edge), payload)
                sent[(ack.stream, ack.seq)] = (edge, kind)
    await nc.close()
    return sent


async def dead_letter_count(nats_url: str, run_id: str, options: dict) -> int:
    nc = await nats.connect(nats_url, **options)
    try:
        return (await nc.jetstream().stream_info(stream_name(run_id, "dead"))).state.messages
    finally:
        await nc.close()


def test_thousand_malformed_messages_land_in_dead_and_the_run_finishes(tiny_model, tmp_path):
    # Long enough that the run is still training when the flood's last message is handled; it is stopped then.
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="poison",
        train={"total_steps": 100_000, "batch_size": 8, "learning_rate": 1e-5},
        rollout={"backend": "hf"},
    )
    run_dir = tmp_path / "runs" / "poison"
    with running_pipeline(config) as run:
        wait_for(lambda: any(r.is_step for r in metric_rows(run_dir)), "the first step", run)
        nats_url = run_info(run_dir, run)["nats_url"]
        operator = operator_options(run_dir)  # the run's broker admits only its roles' keys
        flooded = asyncio.run(flood(nats_url, "poison", operator))
        wait_for(
            lambda: asyncio.run(dead_letter_count(nats_url, "poison", operator)) >= 1000,
            "1,000 dead letters",
            run,
            timeout=240,
        )
        flooded_at = max(r.step for r in metric_rows(run_dir) if r.is_step)
        wait_for(
            lambda: max(r.step for r in metric_rows(run_dir) if r.is_step) >= flooded_at + 3,
            "steps after the flood",
            run,
        )
        letters = asyncio.run(list_dead_letters(nats_url, "poison", 10_000, operator))
        assert rlpipe(run_dir, "stop").returncode == 0
        output, _ = run.communicate(timeout=300)
    assert run.returncode == 0, output[-4000:]
    assert len(flooded) == 1000
    # Every flooded message is in DEAD exactly once, and nothing else is (no healthy group).
    origins = [(letter.origin_stream, letter.origin_sequence) for letter in letters]
    assert len(origins) == len(set(origins)), "a message was dead-lettered twice"
    assert set(origins) - set(flooded) == set(), "DEAD holds messages that were not flooded"
    assert set(flooded) - set(origins) == set(), "flooded messages missing from DEAD"
    assert len(letters) == 1000
    # Each with the reason its kind calls for on its edge, named by the service that consumes that edge.
    consumers = {"prompts": "rollout", "rollouts": "reward", "scored": "reference", "experience": "trainer"}
    for letter in letters:
        edge, kind = flooded[(letter.origin_stream, letter.origin_sequence)]
        assert letter.origin_stream == stream_name("poison", edge)
        assert expected_reason(kind, edge) in letter.reason, (edge, kind, letter.reason)
        assert letter.service.startswith(consumers[edge]), (edge, letter.service)
    restarts = json.loads((run_dir / "run.json").read_text())["restarts"]
    assert restarts == {}, f"a service crashed: {restarts}"
