"""Config of devices, precision and micro-batching: defaults, and bad values refused
at load naming the field and what is allowed."""

from pathlib import Path

import pytest

from services.common.config import ConfigError
from tests.support.runs import run_config

pytestmark = pytest.mark.unit


def load(tmp_path: Path, config_only_model: tuple[Path, Path], **sections: dict):
    return run_config(tmp_path, config_only_model, **sections)


def test_defaults(tmp_path, config_only_model):
    cfg = load(tmp_path, config_only_model)
    assert (cfg.model.device, cfg.model.dtype) == ("auto", "float32")
    assert (cfg.train.master_weights, cfg.train.gradient_checkpointing, cfg.train.micro_batch_tokens) == (
        "float32",
        False,
        None,
    )
    assert (cfg.rollout.gpu_memory_utilization, cfg.rollout.tensor_parallel_size) == (0.9, 1)


def test_the_new_fields_load(tmp_path, config_only_model):
    cfg = load(
        tmp_path,
        config_only_model,
        model={"path": str(config_only_model[0]), "device": "cpu", "dtype": "bfloat16"},
        train={
            "max_seq_len": 32,
            "micro_batch_tokens": 32,
            "master_weights": "model_dtype",
            "gradient_checkpointing": True,
        },
        rollout={"gpu_memory_utilization": 0.5, "tensor_parallel_size": 2},
    )
    assert (cfg.model.device, cfg.model.dtype, cfg.train.micro_batch_tokens) == ("cpu", "bfloat16", 32)
    assert (cfg.train.master_weights, cfg.train.gradient_checkpointing) == ("model_dtype", True)
    assert (cfg.rollout.gpu_memory_utilization, cfg.rollout.tensor_parallel_size) == (0.5, 2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": {"device": "gpu"}}, "model.device: Input should be 'auto', 'cpu' or 'cuda'"),
        ({"model": {"dtype": "float16"}}, "model.dtype: Input should be 'float32' or 'bfloat16'"),
        ({"train": {"master_weights": "float64"}}, "train.master_weights: Input should be 'float32' or 'model_dtype'"),
        (
            {"train": {"max_seq_len": 32, "micro_batch_tokens": 31}},
            "train: micro_batch_tokens (31) is smaller than one sequence of max_seq_len (32) tokens: "
            "set it to at least 32, or null",
        ),
        (
            {"train": {"max_seq_len": 32, "micro_batch_tokens": 64, "grad_accum_steps": 2}},
            "train: micro_batch_tokens and grad_accum_steps both split the optimizer step",
        ),
        ({"train": {"micro_batch_tokens": 0}}, "train.micro_batch_tokens: Input should be greater than or equal to 1"),
        (
            {"train": {"max_seq_len": 32}, "reference": {"micro_batch_tokens": 31}},
            "reference.micro_batch_tokens (31) is smaller than one sequence of train.max_seq_len (32) tokens: "
            "set it to at least 32, or null",
        ),
        ({"rollout": {"gpu_memory_utilization": 0}}, "rollout.gpu_memory_utilization: Input should be greater than 0"),
        (
            {"rollout": {"gpu_memory_utilization": 1.5}},
            "rollout.gpu_memory_utilization: Input should be less than or equal to 1",
        ),
        ({"rollout": {"tensor_parallel_size": 0}}, "rollout.tensor_parallel_size: Input should be greater than or"),
    ],
)
def test_bad_values_are_refused_at_load_naming_the_field(tmp_path, config_only_model, change, message):
    if "model" in change:
        change = {"model": {"path": str(config_only_model[0]), **change["model"]}}
    with pytest.raises(ConfigError) as error:
        load(tmp_path, config_only_model, **change)
    assert message in str(error.value)
