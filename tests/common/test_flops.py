"""The learner's model FLOPs utilization against numbers worked out by hand (services/common/observe/flops.py)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen2Config

from services.common.observe.flops import (
    ModelArithmetic,
    device_peak_flops,
    model_arithmetic,
    model_flops_utilization,
    step_flops,
)

pytestmark = pytest.mark.unit


def test_a_steps_flops_are_6_n_per_token_and_12_l_d_t_per_token_of_attention_per_pass():
    # Sequences of 3 and 5 tokens, N = 10, L = 2, d = 4: 6*10*3 + 12*2*4*3*3 + 6*10*5 + 12*2*4*5*5 = 3744 per pass.
    assert step_flops(10, 2, 4, [3, 5]) == 3744
    assert step_flops(10, 2, 4, [3, 5], passes=2) == 7488
    assert ModelArithmetic(10, 2, 4).step_flops([3, 5], passes=2) == 7488


def test_utilization_is_the_flops_over_what_the_devices_could_do_in_the_step():
    assert model_flops_utilization(494.5e12, seconds=1.0, peak_flops=989e12) == 0.5
    assert model_flops_utilization(494.5e12, seconds=1.0, peak_flops=989e12, devices=2) == 0.25
    assert model_flops_utilization(494.5e12, seconds=2.0, peak_flops=989e12) == 0.25


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),  # the longer match wins over "H100"
        ("NVIDIA H200 NVL", 835e12),  # the PCIe card, not the SXM module "H200" alone names
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", None),  # not in the table: no MFU rather than a guess
    ],
)
def test_the_device_peak_comes_from_its_name_and_an_unknown_device_has_none(name, peak):
    assert device_peak_flops(name) == peak


def test_the_arithmetic_reads_layers_and_attention_width_from_a_transformers_config():
    qwen = Qwen2Config(hidden_size=896, num_attention_heads=14, num_hidden_layers=24)
    assert model_arithmetic(qwen, 494_032_768) == ModelArithmetic(494_032_768, 24, 896)
    smol = LlamaConfig(hidden_size=576, num_attention_heads=9, head_dim=64, num_hidden_layers=30)
    assert model_arithmetic(smol, 134_515_008) == ModelArithmetic(134_515_008, 30, 576)
