"""Partial rollouts' bookkeeping (services/rollout/partial.py): samples grown a chunk at a time keep every token,
its logprob and the version that sampled it, end on a stop or their own limit, and become completions whose
per-token versions are set only where a token's differs from the group's."""

import asyncio

import numpy as np
import pytest

from services.common.episodes.generation import Generation
from services.rollout.partial import PartialSample, generate_in_chunks, newest_version

pytestmark = pytest.mark.unit


class VersionedChunks:
    """Answers each call with ``room`` tokens (the call's number), version = the call's number; ``stops`` maps a
    context's first token to the call at which that sample ends on an end token."""

    def __init__(self, stops: dict[int, int]):
        self.calls: list[tuple[list[list[int]], list[int]]] = []
        self.stops = stops

    async def __call__(self, contexts: list[list[int]], rooms: list[int]) -> list[Generation]:
        self.calls.append((contexts, rooms))
        call = len(self.calls) - 1
        return [
            Generation(
                text="",
                token_ids=np.full(room, 100 + call, dtype=np.int32),
                logprobs=np.full(room, -0.5 - call, dtype=np.float32),
                finish_reason="stop" if self.stops.get(context[0]) == call else "length",
                policy_version=call,
            )
            for context, room in zip(contexts, rooms, strict=True)
        ]


def test_samples_grow_a_chunk_a_call_from_their_kept_tokens_each_token_tagged_with_the_version_that_sampled_it():
    long, short = PartialSample([1, 2], limit=7), PartialSample([3], limit=7)
    chunks = VersionedChunks(stops={3: 1})  # the second sample ends on an end token in the second call
    assert asyncio.run(generate_in_chunks([long, short], 3, chunks)) == 3
    # Each call continues every live sample from its prompt and kept tokens, at most 3 tokens and what is left.
    assert chunks.calls == [
        ([[1, 2], [3]], [3, 3]),
        ([[1, 2, 100, 100, 100], [3, 100, 100, 100]], [3, 3]),
        ([[1, 2, 100, 100, 100, 101, 101, 101]], [1]),
    ]
    assert (long.tokens, long.versions, long.finish_reason) == (
        [100] * 3 + [101] * 3 + [102],
        [0] * 3 + [1] * 3 + [2],
        "length",
    )
    assert long.logprobs == [-0.5] * 3 + [-1.5] * 3 + [-2.5]
    assert (short.tokens, short.versions, short.finish_reason) == ([100] * 3 + [101] * 3, [0] * 3 + [1] * 3, "stop")
    assert newest_version([long, short], loaded=9) == 2
    assert newest_version([PartialSample([1], 4)], loaded=9) == 9  # nothing generated yet: the loaded version


def test_a_completion_carries_per_token_versions_only_where_they_differ_from_its_groups():
    mixed = PartialSample(
        [1], limit=4, tokens=[5, 6, 7], logprobs=[-1, -2, -3], versions=[2, 2, 3], finish_reason="stop"
    )
    completion = mixed.completion(lambda ids: " ".join(map(str, ids)), group_version=3)
    assert completion.token_versions.tolist() == [2, 2, 3] and completion.text == "5 6 7"
    assert completion.versions(3).tolist() == [2, 2, 3] and completion.finish_reason == "stop"
    one = PartialSample([1], limit=2, tokens=[5, 6], logprobs=[-1, -2], versions=[3, 3], finish_reason="length")
    assert one.completion(str, group_version=3).token_versions is None  # written as schema 1, as before


def test_a_chunk_without_its_version_or_without_tokens_cannot_loop_or_go_untagged():
    sample = PartialSample([1], limit=4)
    empty = Generation("", np.zeros(0, np.int32), np.zeros(0, np.float32), "length", policy_version=0)
    sample.extend(empty)
    assert sample.finish_reason == "length"  # an engine that generates nothing ends the sample
    untagged = Generation("", np.ones(1, np.int32), np.zeros(1, np.float32), "length")
    with pytest.raises(ValueError, match="which policy version"):
        PartialSample([1], limit=4).extend(untagged)
