"""The memory estimate against numbers worked out by hand (services/cli/sizing.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.sizing import (
    GIB,
    ModelShape,
    SizingInputs,
    estimate,
    lora_parameters,
    memory_shortfall,
    parse_meminfo,
    placements,
    read_model_shape,
    swap_in_use,
    with_headroom,
)
from tests.support.models import SMOLLM2_CONFIG

pytestmark = pytest.mark.unit

# 2 layers, hidden 4, MLP 8, 2 heads of 2 and 1 kv head, vocabulary 10, tied embeddings.
SMALL = ModelShape(layers=2, hidden=4, intermediate=8, heads=2, kv_heads=1, vocab=10, tied_embeddings=True, head_dim=2)
# embeddings 10*4 + 2 layers * (q,o 2*4*4 + k,v 2*4*2 + MLP 3*4*8 + norms 2*4 = 152) + final norm 4
SMALL_PARAMETERS = 40 + 2 * 152 + 4
# Per token and layer: 4 hidden-wide tensors (16) + 3 q-wide (12) + 3 kv-wide (6) + 4 MLP-wide (32).
SMALL_ACTIVATIONS_PER_TOKEN_LAYER = 66
SMALLER_BATCH = SizingInputs(
    micro_batch_tokens=10,
    max_seq_len=5,
    group_size=2,
    reference_groups=1,
    rollout_sequences=3,
    model_dtype="bfloat16",
    master_dtype="float32",
)


def write_config(folder: Path, config: dict) -> Path:
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_smollm2_shape_counts_its_134_515_008_parameters(tmp_path: Path) -> None:
    shape = read_model_shape(write_config(tmp_path, SMOLLM2_CONFIG))
    assert shape.parameters == 134_515_008  # what torch counts for the imported SmolLM2-135M


def test_qwen2_counts_the_biases_of_its_q_k_and_v_projections(tmp_path: Path) -> None:
    llama = read_model_shape(write_config(tmp_path, SMOLLM2_CONFIG))
    qwen = read_model_shape(write_config(tmp_path, {**SMOLLM2_CONFIG, "model_type": "qwen2"}))
    assert qwen.qkv_bias and not llama.qkv_bias
    assert qwen.parameters - llama.parameters == 30 * (576 + 2 * 192)


def test_untied_embeddings_add_an_output_matrix_of_vocab_by_hidden() -> None:
    untied = ModelShape(**{**SMALL.__dict__, "tied_embeddings": False})
    assert untied.parameters - SMALL.parameters == 10 * 4


def test_a_config_without_head_dim_or_kv_heads_takes_hidden_over_heads_and_all_heads(tmp_path: Path) -> None:
    config = {k: v for k, v in SMOLLM2_CONFIG.items() if k not in ("head_dim", "num_key_value_heads")}
    shape = read_model_shape(write_config(tmp_path, config))
    assert (shape.head_dim, shape.kv_heads) == (64, 9)


def test_a_config_missing_a_dimension_is_refused_naming_it(tmp_path: Path) -> None:
    config = {k: v for k, v in SMOLLM2_CONFIG.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        read_model_shape(write_config(tmp_path, config))


def test_trainer_weights_gradients_and_adamw_moments_are_float32_per_parameter() -> None:
    est = estimate(SMALL, SMALLER_BATCH)
    assert SMALL.parameters == SMALL_PARAMETERS
    assert (est.trainer.weights, est.trainer.gradients, est.trainer.optimizer) == (
        SMALL_PARAMETERS * 4,
        SMALL_PARAMETERS * 4,
        SMALL_PARAMETERS * 8,
    )


def test_activations_without_checkpointing_grow_with_depth_and_with_it_keep_one_layer() -> None:
    est = estimate(SMALL, SMALLER_BATCH)
    assert SMALL.activations_per_token_layer == SMALL_ACTIVATIONS_PER_TOKEN_LAYER
    # bfloat16: 2 bytes; 10 tokens.
    assert est.trainer.activations_full == 2 * 10 * 66 * 2
    # each layer keeps its 4-wide input, and one layer is whole again while recomputed
    assert est.trainer.activations_checkpointed == 2 * 10 * 4 * 2 + 10 * 66 * 2
    assert est.trainer.activations == est.trainer.activations_full
    checkpointed = estimate(SMALL, SizingInputs(**{**SMALLER_BATCH.__dict__, "gradient_checkpointing": True}))
    assert checkpointed.trainer.activations == est.trainer.activations_checkpointed


def test_logits_hold_the_model_dtype_copy_and_float32_log_softmax_and_its_gradient() -> None:
    assert estimate(SMALL, SMALLER_BATCH).trainer.logits == 10 * 10 * (2 + 4 + 4)


def test_reference_holds_model_dtype_weights_one_layer_and_logits_of_its_batch() -> None:
    reference = estimate(SMALL, SMALLER_BATCH).reference
    tokens = 1 * 2 * 5  # one group of two sequences of 5
    assert reference.weights == SMALL_PARAMETERS * 2
    assert reference.working == tokens * 66 * 2 + tokens * 10 * (2 + 4)


def test_rollout_kv_cache_covers_every_sequence_in_flight_unless_configured() -> None:
    rollout = estimate(SMALL, SMALLER_BATCH).rollout
    # keys and values, 2 layers, 1 kv head of 2, bfloat16; 3 sequences of 5 tokens
    assert rollout.working == 3 * 5 * (2 * 2 * 2) * 2
    configured = estimate(SMALL, SizingInputs(**{**SMALLER_BATCH.__dict__, "kv_cache_bytes": 256 * 2**20}))
    assert configured.rollout.working == 256 * 2**20


def test_ppo_with_a_separate_critic_trains_a_second_model_and_grpo_or_a_value_head_does_not() -> None:
    ppo = estimate(SMALL, SizingInputs(**{**SMALLER_BATCH.__dict__, "algorithm": "ppo"}))
    assert ppo.trainer.critic == SMALL_PARAMETERS * 4 * 4 + ppo.trainer.activations
    assert estimate(SMALL, SMALLER_BATCH).trainer.critic == 0
    head = estimate(SMALL, SizingInputs(**{**SMALLER_BATCH.__dict__, "algorithm": "ppo", "critic": "head"}))
    assert head.trainer.critic == 0


def test_lora_trains_only_adapters_beside_the_frozen_base() -> None:
    # rank 1 per layer, the default targets: q (4 + 4) + k, v (4 + 2) each + o (4 + 4) = 28; two layers
    assert lora_parameters(SMALL, 1) == 56
    # and the MLP's three: (4 + 8) * 3 = 36 more per layer
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert lora_parameters(SMALL, 1, every) == 2 * (28 + 36)
    est = estimate(SMALL, SizingInputs(**{**SMALLER_BATCH.__dict__, "lora_rank": 1}))
    assert est.trainable_parameters == 56
    assert est.trainer.weights == SMALL_PARAMETERS * 4 + 56 * 4
    assert (est.trainer.gradients, est.trainer.optimizer) == (56 * 4, 56 * 8)


def test_a_lora_target_that_is_not_a_projection_is_refused_naming_the_projections() -> None:
    with pytest.raises(ValueError, match=r"\['qkv'\] are not among a layer's projections: q_proj, k_proj"):
        lora_parameters(SMALL, 1, ("qkv",))


def test_fsdp2_shards_weights_gradients_and_moments_but_not_activations() -> None:
    trainer = estimate(SMALL, SMALLER_BATCH).trainer
    sharded = SMALL_PARAMETERS * 16
    assert trainer.per_rank(4) == -(-sharded // 4) + trainer.activations + trainer.logits


def big_trainer_inputs() -> tuple[ModelShape, SizingInputs]:
    """SmolLM2's shape at a batch whose reference is smaller than half the trainer's shards."""
    shape = ModelShape(30, 576, 1536, 9, 3, 49152, True, 64)
    return shape, SizingInputs(micro_batch_tokens=1024, max_seq_len=256, rollout_sequences=8, kv_cache_bytes=0)


def test_placement_picks_the_smallest_fsdp2_world_size_whose_rank_fits() -> None:
    shape, inputs = big_trainer_inputs()
    est = estimate(shape, inputs)
    gpu = with_headroom(est.trainer.per_rank(1))  # one unsharded trainer exactly
    # beside the reference, one rank is too big but half the shards leave room for it
    assert with_headroom(est.trainer.per_rank(2) + est.reference.total) <= gpu
    layouts = {layout.name: layout for layout in placements(est, gpus=4, gpu_bytes=gpu)}
    assert not layouts["all roles on one GPU"].fits
    beside = layouts["reference beside trainer rank 0"]
    assert (beside.fits, beside.trainer_world_size, beside.gpus_used) == (True, 2, 3)
    own = layouts["reference on its own GPU"]
    assert (own.fits, own.trainer_world_size, own.gpus_used) == (True, 1, 3)


def test_a_separate_reference_needs_a_third_gpu() -> None:
    shape, inputs = big_trainer_inputs()
    layouts = {layout.name: layout for layout in placements(estimate(shape, inputs), gpus=2, gpu_bytes=80 * GIB)}
    assert layouts["reference on its own GPU"].fits is False
    assert layouts["reference on its own GPU"].detail == "needs at least 3 GPUs"
    assert layouts["all roles on one GPU"].fits is True


MEMINFO = """MemTotal:       24683520 kB
MemFree:          300000 kB
MemAvailable:    2000000 kB
SwapTotal:       1000000 kB
SwapFree:         400000 kB
"""


def test_meminfo_is_read_in_bytes() -> None:
    host = parse_meminfo(MEMINFO)
    assert (host.total, host.available, host.swap_used) == (24683520 * 1024, 2000000 * 1024, 600000 * 1024)


def test_swap_in_use_is_noted_and_a_need_past_available_memory_names_the_swap_it_would_use() -> None:
    host = parse_meminfo(MEMINFO)
    assert swap_in_use(host) == "0.57 GiB of swap already in use"
    # 2000000 kB needed, +25% headroom: past the 2000000 kB available
    assert memory_shortfall(host, host_need=2000000 * 1024) == (
        "host memory: 2.38 GiB needed, 1.91 GiB available (it would swap, 0.38 GiB swap free)"
    )


def test_a_host_with_room_and_no_swap_in_use_has_nothing_to_warn_of() -> None:
    host = parse_meminfo(MEMINFO.replace("SwapFree:         400000", "SwapFree:        1000000"))
    assert swap_in_use(host) is None
    assert memory_shortfall(host, host_need=1000 * 1024) is None
