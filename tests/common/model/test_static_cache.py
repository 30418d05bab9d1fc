"""The static caches' shapes without a model: which batch a call of so many rows runs at, and which cache the engine
hands ``generate`` (kept per batch size, grown in the token bucket's steps, never shrunk). The caches are built
from a model config only; their tensors would be allocated by the first ``generate`` that fills them."""

import pytest
from transformers import LlamaConfig

from services.common.model.static_cache import StaticCaches, rows_for

pytestmark = pytest.mark.unit

POWERS = [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize(
    ("rows", "buckets", "max_rows", "expected"),
    [
        (1, POWERS, None, 1),
        (3, POWERS, None, 4),
        (8, POWERS, None, 8),
        (9, POWERS, None, 16),
        (33, POWERS, None, 64),  # above the largest: a multiple of it
        (65, POWERS, None, 96),
        (20, POWERS, 24, 24),  # the per-call cap is a memory bound: no bucket past it
        (30, POWERS, 24, 30),  # a call already past the cap is not cut here (calls() splits at the cap first)
        (5, [1], None, 5),  # [1]: no filler, every row count its own shape
        (3, [8, 64], None, 8),
    ],
)
def test_a_calls_rows_go_up_to_the_smallest_bucket_holding_them(rows, buckets, max_rows, expected):
    assert rows_for(rows, buckets, max_rows) == expected


def test_every_row_count_up_to_the_cap_runs_at_one_of_few_batch_sizes():
    sizes = {rows_for(rows, [1, 2, 4, 8, 16, 32, 64, 128, 256], 256) for rows in range(1, 257)}

    assert sizes == {1, 2, 4, 8, 16, 32, 64, 128, 256}


def caches() -> StaticCaches:
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    return StaticCaches(config, bucket_tokens=16, batch_buckets=POWERS)


def test_a_batch_size_keeps_its_cache_across_calls_while_it_is_long_enough():
    static = caches()

    first = static.cache(8, 64)
    again = static.cache(8, 48)  # shorter: the kept one serves

    assert again is first and static.kept[8][0] == 64


def test_a_longer_call_replaces_the_cache_which_then_serves_shorter_calls_without_shrinking():
    static = caches()
    short = static.cache(8, 64)

    longer = static.cache(8, 128)
    after = static.cache(8, 64)

    assert longer is not short and after is longer
    assert static.kept[8][0] == 128
    assert longer.get_max_cache_shape() == 128


def test_each_batch_size_has_a_cache_of_its_own():
    static = caches()

    eight, four = static.cache(8, 64), static.cache(4, 64)

    assert eight is not four and static.cache(8, 64) is eight and static.cache(4, 64) is four
    assert sorted(static.kept) == [4, 8]
