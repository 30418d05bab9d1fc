"""Partial rollouts: a batch's samples generated a chunk of tokens at a time, the newest weights loaded in between.

With ``rollout.inflight_updates`` a sample does not have to finish on the version it started with. Each engine
call generates at most ``rollout.inflight_chunk_tokens`` new tokens of every live sample; before each call the
caller loads the newest version the trainer has published. A sample goes on from its kept tokens: its context is
the prompt and every token generated so far, computed again under the new weights (the engine's prefix cache is
reset on a load, so no key or value of the old weights is reused: an interrupt-and-resume, not a kept KV cache).
Each token records the version that sampled it, which the trainer's staleness bound and off-policy corrections
read per token (``Completion.token_versions``).

Chunking alone changes no distribution: a token is drawn from the policy given its context, so without a new
version in between, a sample generated in chunks is distributed as one generated in a single call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from services.common.episodes.generation import Generation
from services.common.transport.messages import Completion

# Generates one chunk of each context: (contexts, new-token limits) -> one Generation each, its policy_version set.
ChunkGenerator = Callable[[list[list[int]], list[int]], Awaitable[list[Generation]]]


@dataclass
class PartialSample:
    """One sample as it grows: its prompt, its token limit, and what the chunks so far generated."""

    prompt: list[int]
    limit: int  # new tokens it may have in all
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each token
    finish_reason: str | None = None  # "stop" | "length" once it has ended

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def room(self, chunk_tokens: int) -> int:
        return min(chunk_tokens, self.limit - len(self.tokens))

    def extend(self, generation: Generation) -> None:
        """Append a chunk. It ends the sample when it stopped (an end token), when the sample's limit is reached,
        or when it brought nothing (an engine that generates nothing would otherwise be asked forever)."""
        if generation.policy_version is None:
            raise ValueError("a chunk must say which policy version sampled it")
        new = generation.token_ids.tolist()
        self.tokens += new
        self.logprobs += generation.logprobs.tolist()
        self.versions += [generation.policy_version] * len(new)
        if generation.finish_reason == "stop":
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.limit or not new:
            self.finish_reason = "length"

    def completion(self, decode: Callable[[list[int]], str], group_version: int) -> Completion:
        """The finished sample; per-token versions only where a token's differs from ``group_version``."""
        assert self.finish_reason is not None, "a sample becomes a completion once it has ended"
        versions = np.asarray(self.versions, dtype=np.int32)
        return Completion(
            text=decode(self.tokens),
            token_ids=np.asarray(self.tokens, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            finish_reason="stop" if self.finish_reason == "stop" else "length",
            token_versions=versions if (versions != group_version).any() else None,
        )


async def generate_in_chunks(samples: list[PartialSample], chunk_tokens: int, generate: ChunkGenerator) -> int:
    """Generate every sample to its end, ``chunk_tokens`` at most per call of ``generate``, which loads the newest
    version before it generates. Returns the number of calls made."""
    calls = 0
    while live := [sample for sample in samples if not sample.done]:
        generations = await generate([s.context for s in live], [s.room(chunk_tokens) for s in live])
        calls += 1
        for sample, generation in zip(live, generations, strict=True):
            sample.extend(generation)
    return calls


def newest_version(samples: list[PartialSample], loaded: int) -> int:
    """The version a group of samples is tagged with (``RolloutGroup.policy_version``): the newest that sampled a
    token of it, older tokens carrying their own (``loaded`` when no sample has a token)."""
    return max((max(s.versions) for s in samples if s.versions), default=loaded)
