"""The rollout's vLLM settings reach the engine vLLM builds: read back from the real engine's config, not a mock."""

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from services.common.model.modeling import load_model, load_tokenizer, pack, response_logits, token_logprobs
from services.common.transport.weightsync.snapshot import snapshot_of
from services.rollout.engines import VllmEngine, vllm_engine_args
from tests.support.runs import run_config
from tests.support.weights import PAIRS, sync_over_grpc, vllm_response_logprobs

pytestmark = pytest.mark.integration


def test_memory_share_kv_cache_size_and_dtype_reach_the_running_vllm_engine(tiny_model, tmp_path):
    model_dir, _ = tiny_model
    cfg = run_config(
        tmp_path,
        tiny_model,
        model={"path": str(model_dir), "dtype": "bfloat16"},
        rollout={"gpu_memory_utilization": 0.35, "kv_cache_mib": 48},
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

    cfg = run_config(
        tmp_path, tiny_model, rollout={"gpu_memory_utilization": 0.6, "tensor_parallel_size": 2, "kv_cache_mib": None}
    )
    vllm_config = EngineArgs(**vllm_engine_args(cfg)).create_engine_config()
    assert vllm_config.parallel_config.tensor_parallel_size == 2
    assert vllm_config.parallel_config.world_size == 2
    assert vllm_config.cache_config.gpu_memory_utilization == 0.6
    assert vllm_config.cache_config.kv_cache_memory_bytes is None  # sized from the share of memory instead


@pytest.mark.e2e
def test_a_tensor_parallel_engine_takes_a_weight_sync_into_both_its_workers(tiny_model, tmp_path, monkeypatch):
    """Two CPU workers, each its own process holding half of every layer: the synced weights reach both, so the
    engine then scores as the trainer's model does."""
    model_dir, _ = tiny_model
    cfg = run_config(tmp_path, tiny_model, rollout={"tensor_parallel_size": 2})
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[-1]}")  # one core per worker
    from vllm import envs

    envs.disable_envs_cache()  # an engine started earlier in this process froze vLLM's view of the environment
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    pairs = [
        (tokenizer.encode(p, add_special_tokens=False), [*tokenizer.encode(r, add_special_tokens=False), eos])
        for p, r in PAIRS
    ]
    policy = load_model(model_dir).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
        batch = pack(pairs, tokenizer.pad_token_id)
        expected = [
            row[: len(r)].numpy()
            for row, (_, r) in zip(token_logprobs(response_logits(policy, batch), batch.targets), pairs, strict=True)
        ]

    engine_thread = ThreadPoolExecutor(max_workers=1)
    engine = engine_thread.submit(VllmEngine, cfg).result()
    assert engine.llm.llm_engine.vllm_config.parallel_config.world_size == 2

    def max_gap() -> float:
        got = engine_thread.submit(vllm_response_logprobs, engine, pairs).result()
        return max(float(np.abs(g - e).max()) for g, e in zip(got, expected, strict=True))

    try:
        before = max_gap()
        assert asyncio.run(sync_over_grpc(engine, engine_thread, snapshot_of(policy, version=3, step=3))) == 3
        after = max_gap()
    finally:
        engine.llm.llm_engine.engine_core.shutdown()  # its worker processes, while this test's logging is still open
    assert before > 1e-2, f"perturbed weights should score differently before the sync (gap {before})"
    assert after < 1e-3, f"after the sync the two workers' vLLM and transformers differ by {after}"
