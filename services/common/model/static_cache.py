"""Static KV caches for ``generate``, kept so that the compiled decode step sees few shapes.

On a CUDA device transformers compiles the model's decode step when ``generate`` runs over a static cache
(``torch.compile``, mode ``reduce-overhead``: CUDA graphs; ``_valid_auto_compile_criteria``). The step's tensors
are shaped by the batch ``B`` and the cache's length ``L`` only: input ids and positions ``(B, 1)``, the 4-D mask
``(B, 1, 1, L)`` (built outside the compiled call), each layer's keys and values ``(B, heads, L, head_dim)``.
Dynamo recompiles when a shape first changes (then traces it dynamic), the CUDA graph trees record a graph for each
distinct ``(B, L)``, and record again when the cache's tensors move (they are marked static addresses, unguarded).

transformers' own static cache suits calls of one shape, not a rollout's: up to 5.14 ``generate`` keeps one cache
on the model and builds a new one, sized to that call, whenever the batch differs from the last call's or the call
needs more length; from 5.15 it builds a new cache every call (as long as the longest any call has needed), so
every call's tensors are new. So the cache is the caller's: ``StaticCaches`` keeps one cache per batch bucket,
reset between calls and replaced only when a call needs more length than it holds (lengths are multiples of
``bucket_tokens`` and never shrink). A call's rows are padded up to their bucket (``rows_for``) with copies of one
of its rows whose outputs are dropped (``batch_generation``). The ``(B, L)`` shapes a run sees are at most its
buckets times the length steps up to its longest sequence, in a steady run one per bucket; the memory held is
every used bucket's cache (with power-of-two buckets, under twice the largest's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import StaticCache


def rows_for(rows: int, buckets: Sequence[int], max_rows: int | None = None) -> int:
    """The batch a call of ``rows`` rows runs at: the smallest of ``buckets`` (ascending) that holds them, a
    multiple of the largest above it; never past ``max_rows`` (rollout.hf.max_sequences_per_call, a memory bound)
    unless ``rows`` itself is."""
    largest = buckets[-1]
    size = next((b for b in buckets if b >= rows), -(-rows // largest) * largest)
    return size if max_rows is None else max(rows, min(size, max_rows))


class StaticCaches:
    """One model's static caches, one per batch size, each reused call after call (see the module docstring)."""

    def __init__(
        self, config: Any, bucket_tokens: int, batch_buckets: Sequence[int], max_rows: int | None = None
    ) -> None:
        self.config = config  # the model's PretrainedConfig: its layers, heads and sliding windows
        self.bucket_tokens = bucket_tokens
        self.batch_buckets = list(batch_buckets)
        self.max_rows = max_rows
        self.kept: dict[int, tuple[int, StaticCache]] = {}  # batch size -> (length, its cache)

    def rows_for(self, rows: int) -> int:
        return rows_for(rows, self.batch_buckets, self.max_rows)

    def cache(self, rows: int, length: int) -> StaticCache:
        """An empty static cache of ``rows`` rows holding ``length`` tokens at least: the one kept for ``rows``,
        reset, while it is long enough; else a new one as long as the longer of the two, which replaces it. Its
        tensors are allocated by the first ``generate`` that fills them, on the model's device and dtype."""
        held, kept = self.kept.get(rows, (0, None))
        if kept is not None and held >= length:
            kept.reset()
            return kept
        length = max(length, held)
        cache = StaticCache(config=self.config, max_cache_len=length)
        self.kept[rows] = (length, cache)
        return cache
