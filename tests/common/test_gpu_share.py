"""A role's share of a shared GPU, applied at its start (services/common/model/gpu_share.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.common.config import ConfigError
from services.common.model.gpu_share import CUDA_CONTEXT_BYTES, allocator_fraction, apply_gpu_share, decide_share
from tests.support.models import config_only
from tests.support.runs import run_config

pytestmark = pytest.mark.unit
GIB = 2**30


@pytest.fixture
def config_with(tmp_path: Path):
    folders = config_only(tmp_path)

    def load(shares: dict[str, float], **sections: dict):
        return run_config(tmp_path, folders, service={"gpu_memory_fraction": shares}, **sections)

    return load


def never() -> int:
    raise AssertionError("the GPU's memory was asked for although no cap is due")


def test_the_allocator_gets_the_share_less_a_cuda_context():
    # Half of 80 GiB is 40 GiB; the context's 0.5 GiB of it lies outside torch's allocator.
    assert allocator_fraction(0.5, 80 * GIB, "trainer") == (40 * GIB - CUDA_CONTEXT_BYTES) / (80 * GIB)
    assert CUDA_CONTEXT_BYTES == GIB // 2


def test_a_share_that_cannot_hold_a_cuda_context_is_refused_naming_the_roles_field():
    with pytest.raises(ConfigError, match=r"service.gpu_memory_fraction.reference: 0.005 of this GPU's 80.0 GiB"):
        allocator_fraction(0.005, 80 * GIB, "reference")


def test_a_role_on_a_gpu_caps_its_allocator_at_its_share(config_with):
    cfg = config_with({"trainer": 0.25, "rollout": 0.1}, rollout={"backend": "hf"})
    trainer = decide_share(cfg, "trainer", cuda_available=True, total_bytes=lambda: 80 * GIB)
    assert trainer.allocator_fraction == allocator_fraction(0.25, 80 * GIB, "trainer")
    rollout = decide_share(cfg, "rollout", cuda_available=True, total_bytes=lambda: 80 * GIB)
    assert rollout.allocator_fraction == allocator_fraction(0.1, 80 * GIB, "rollout")  # transformers: torch's cap


def test_a_share_set_by_hand_that_leaves_the_allocator_under_its_floor_says_so_naming_the_field(config_with):
    """The plan keeps ALLOCATOR_FLOOR_BYTES in every share it computes; a share set by hand may not, and a role
    whose allocator cannot hold cuBLAS's workspace beside its model runs out of memory at its first matmuls."""
    cfg = config_with({"reference": 0.004, "trainer": 0.25})
    small = decide_share(cfg, "reference", cuda_available=True, total_bytes=lambda: 140 * GIB)
    assert small.under_floor and "raise service.gpu_memory_fraction.reference" in small.reason
    assert not decide_share(cfg, "trainer", cuda_available=True, total_bytes=lambda: 140 * GIB).under_floor


def test_no_cap_on_a_cpu_for_a_vllm_rollout_for_a_reward_without_a_model_or_a_role_without_a_share(config_with):
    cfg = config_with({"trainer": 0.25, "rollout": 0.1, "reward": 0.1})
    cpu = decide_share(cfg, "trainer", cuda_available=False, total_bytes=never)
    assert (cpu.allocator_fraction, cpu.reason) == (None, "not applied: this role computes on the CPU")
    vllm = decide_share(cfg, "rollout", cuda_available=True, total_bytes=never)
    assert vllm.allocator_fraction is None and "vLLM keeps to rollout.gpu_memory_utilization" in vllm.reason
    reward = decide_share(cfg, "reward", cuda_available=True, total_bytes=never)
    assert reward.allocator_fraction is None and "no torch model on a device" in reward.reason
    unset = decide_share(cfg, "reference", cuda_available=True, total_bytes=never)
    assert (unset.share, unset.allocator_fraction) == (None, None)


def test_a_role_with_a_share_says_at_start_on_this_cpu_that_it_caps_nothing(config_with, caplog):
    import torch  # noqa: F401  a role that computes with torch has imported it by the time its share is applied

    cfg = config_with({"reference": 0.3})
    with caplog.at_level(logging.INFO):
        decided = apply_gpu_share(cfg, "reference")
        apply_gpu_share(cfg, "trainer")  # no share: nothing to say
    assert decided.allocator_fraction is None
    logged = [record.fields for record in caplog.records if record.getMessage() == "gpu_memory_share"]
    assert [(fields["share"], fields["reason"]) for fields in logged] == [
        (0.3, "not applied: this role computes on the CPU")
    ]
