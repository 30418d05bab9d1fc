"""The transformers engine over a static KV cache (rollout.hf.cache: static) on the tiny model: calls of many batch
sizes and lengths (multi-turn turns, in-flight chunks) run at few (batch, cache length) shapes, on caches the engine
keeps across calls, and the filler rows that pad a call to its batch bucket change no real row's tokens or logprobs
and never reach the results."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from services.common.config import SamplingConfig
from services.common.episodes.generation import Generation
from services.common.model.datasets import load_jsonl
from services.rollout.engines import HfEngine
from services.rollout.partial import PartialSample, generate_in_chunks
from tests.support.runs import run_config

pytestmark = pytest.mark.integration

BUCKET_TOKENS = 16
TOLERANCE = 1e-4  # float32 on the CPU: batches of other shapes multiply in other orders
COLD = SamplingConfig(group_size=1, max_new_tokens=6, temperature=1e-4)  # sampling is the argmax


def engine_for(model_dir, data_dir, tmp_path, **hf) -> HfEngine:
    tmp_path.mkdir(exist_ok=True)
    rollout = {"backend": "hf", "hf": {"static_bucket_tokens": BUCKET_TOKENS, **hf}}
    return HfEngine(run_config(tmp_path, (model_dir, data_dir), rollout=rollout))


@dataclass(frozen=True)
class Call:
    """One ``generate`` call over a static cache: its batch, the cache's length, the cache and where its tensors
    lie after the call."""

    rows: int
    length: int
    cache: Any
    keys: int  # the first layer's keys' data pointer

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.length


def recorded(engine: HfEngine) -> list[Call]:
    """Each ``generate`` call the engine makes, as it makes them."""
    calls, generate = [], engine.model.generate

    def record(*args, **kwargs):
        sequences = generate(*args, **kwargs)
        cache = kwargs["past_key_values"]
        rows = kwargs["input_ids"].shape[0]
        calls.append(Call(rows, cache.get_max_cache_shape(), cache, cache.layers[0].keys.data_ptr()))
        return sequences

    engine.model.generate = record
    return calls


def contexts_of(engine: HfEngine, data_dir, count: int) -> list[list[int]]:
    """``count`` held-out prompts as token ids, as they come (short: one token bucket holds each)."""
    rows = load_jsonl(data_dir / "eval.jsonl")[:count]
    return [engine.tokenizer.encode(row["prompt"], add_special_tokens=False) for row in rows]


def assert_alike(expected: list[Generation], got: list[Generation]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOLERANCE)


SIZES = [3, 5, 6, 7, 9, 12, 13, 16, 2, 3, 7, 11]  # live episodes per turn, as multi-turn and in-flight calls vary


def test_twelve_calls_of_ten_batch_sizes_run_at_four_shapes_each_on_one_cache_kept_across_calls(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    bucketed = engine_for(model_dir, data_dir, tmp_path / "bucketed", cache="static")
    exact = engine_for(model_dir, data_dir, tmp_path / "exact", cache="static", static_batch_buckets=[1])
    contexts = contexts_of(bucketed, data_dir, max(SIZES))
    assert max(map(len, contexts)) <= BUCKET_TOKENS  # one width for every call: only the batch varies
    calls, exact_calls = recorded(bucketed), recorded(exact)

    for n in SIZES:
        turns = bucketed.generate_turns(contexts[:n], [4] * n, COLD, ["5"])
        assert_alike(exact.generate_turns(contexts[:n], [4] * n, COLD, ["5"]), turns)

    assert [c.rows for c in calls] == [4, 8, 8, 8, 16, 16, 16, 16, 2, 4, 8, 16]
    assert {c.shape for c in calls} == {(2, 32), (4, 32), (8, 32), (16, 32)}  # width 16 + room 16
    for shape in {c.shape for c in calls}:  # one cache per shape, its tensors where they were: nothing re-allocated
        same = [c for c in calls if c.shape == shape]
        assert all(c.cache is same[0].cache and c.keys == same[0].keys for c in same)
    # Without batch buckets, every batch size is a shape (and a compile, and a CUDA graph) of its own.
    assert {c.shape for c in exact_calls} == {(n, 32) for n in SIZES}


def test_real_rows_of_a_call_padded_with_filler_rows_are_the_dynamic_paths_and_the_fillers_are_dropped(
    tiny_model, tmp_path
):
    model_dir, data_dir = tiny_model
    dynamic = engine_for(model_dir, data_dir, tmp_path / "dynamic")
    static = engine_for(model_dir, data_dir, tmp_path / "static", cache="static")
    calls = recorded(static)
    prompts = contexts_of(static, data_dir, 3)
    prompts = [p * (1 + i) for i, p in enumerate(prompts)]  # lengths differ within the call
    cold = COLD.model_copy(update={"group_size": 3})

    expected = dynamic.generate(prompts, cold, 64)
    groups = static.generate(prompts, cold, 64)

    assert [c.rows for c in calls] == [16]  # 3 prompts x 3, padded with 7 filler rows
    assert [len(group) for group in groups] == [3, 3, 3]
    assert_alike([g for group in expected for g in group], [g for group in groups for g in group])


def test_in_flight_chunks_run_at_bucketed_shapes_on_caches_that_only_grow_and_draw_as_the_dynamic_path(
    tiny_model, tmp_path
):
    """The in-flight path: every live sample's next chunk in one call, so the batch shrinks as samples end and the
    contexts grow by a chunk a call. Its calls take the same rounding: batch buckets, a cache length in steps of
    the token bucket that never shrinks, one cache per shape."""
    model_dir, data_dir = tiny_model
    dynamic = engine_for(model_dir, data_dir, tmp_path / "dynamic")
    static = engine_for(model_dir, data_dir, tmp_path / "static", cache="static")
    calls = recorded(static)
    prompts = contexts_of(static, data_dir, 11)
    limits = [4 + 3 * i for i in range(len(prompts))]  # 4 to 34 new tokens: samples end chunk after chunk

    def chunked(engine: HfEngine) -> list[PartialSample]:
        engine.end_tokens = frozenset()  # the tiny model ends in a few tokens: here every sample runs to its limit
        samples = [PartialSample(p, limit) for p, limit in zip(prompts, limits, strict=True)]

        async def chunk(contexts: list[list[int]], rooms: list[int]) -> list[Generation]:
            generations = engine.generate_turns(contexts, rooms, COLD, [])
            for generation in generations:
                generation.policy_version = 0
            return generations

        asyncio.run(generate_in_chunks(samples, 5, chunk))
        return samples

    expected, got = chunked(dynamic), chunked(static)

    for a, b in zip(expected, got, strict=True):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOLERANCE)
    live = [c.rows for c in calls]
    assert len(calls) >= 4 and set(live) <= {1, 2, 4, 8, 16} and live == sorted(live, reverse=True)
    assert all(c.length % BUCKET_TOKENS == 0 for c in calls)
    for rows in set(live):
        lengths = [c.length for c in calls if c.rows == rows]
        assert lengths == sorted(lengths)  # a batch size's cache grows with the contexts, never shrinks
    for shape in {c.shape for c in calls}:
        assert len({id(c.cache) for c in calls if c.shape == shape}) == 1
