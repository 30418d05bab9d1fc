"""bench/learner_shape.py's model is Qwen2.5-0.5B's shape, counted without building it."""

import json

import pytest

from bench.learner_shape import QWEN25_05B
from services.cli.sizing import read_model_shape

pytestmark = pytest.mark.unit


def test_the_bench_model_has_qwen2_5_0_5b_s_494_million_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    shape = read_model_shape(tmp_path)
    # 494,032,768: the count Qwen publishes for Qwen2.5-0.5B (tied embeddings, biases on q, k and v).
    assert shape.parameters == 494_032_768
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.qkv_bias) == (24, 896, 14, 2, True)
