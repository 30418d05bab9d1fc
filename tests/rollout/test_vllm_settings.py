"""The rollout's vLLM settings reach the engine vLLM builds: read back from the real engine's config, not a mock."""

import torch

from services.common.config import load_config
from services.rollout.engines import VllmEngine, vllm_engine_args
from tests.conftest import write_config


def test_memory_share_kv_cache_size_and_dtype_reach_the_running_vllm_engine(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml",
            model_dir,
            data_dir,
            tmp_path / "runs",
            model={"path": str(model_dir), "dtype": "bfloat16"},
            rollout={"gpu_memory_utilization": 0.35, "kv_cache_mib": 48},
        )
    )
    engine = VllmEngine(cfg)
    vllm_config = engine.llm.llm_engine.vllm_config
    assert vllm_config.cache_config.gpu_memory_utilization == 0.35
    assert vllm_config.cache_config.kv_cache_memory_bytes == 48 << 20
    assert vllm_config.parallel_config.tensor_parallel_size == 1
    assert vllm_config.model_config.dtype == torch.bfloat16  # rollout.dtype auto: the trainer's model.dtype
    assert vllm_config.model_config.max_model_len == cfg.train.max_seq_len


def test_a_tensor_parallel_size_and_no_kv_cache_size_reach_vllms_resolved_config(tiny_model, tmp_path):
    """Two ranks of tensor parallelism need two devices to start on; vLLM's own config resolution is what this
    machine can run, and what the engine is built from."""
    from vllm.engine.arg_utils import EngineArgs

    model_dir, data_dir = tiny_model
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml",
            model_dir,
            data_dir,
            tmp_path / "runs",
            rollout={"gpu_memory_utilization": 0.6, "tensor_parallel_size": 2, "kv_cache_mib": None},
        )
    )
    vllm_config = EngineArgs(**vllm_engine_args(cfg)).create_engine_config()
    assert vllm_config.parallel_config.tensor_parallel_size == 2
    assert vllm_config.parallel_config.world_size == 2
    assert vllm_config.cache_config.gpu_memory_utilization == 0.6
    assert vllm_config.cache_config.kv_cache_memory_bytes is None  # sized from the share of memory instead
