"""A role's share of a GPU that several roles share: the cap its torch allocator gets when the role starts.

``service.gpu_memory_fraction`` names each role's share of the GPU's memory, per process; ``rollout.replicas:
auto`` has the launcher fill in the rest from ``rlpipe plan`` (services/cli/launch/placement.py). A share covers
all the process holds on the device, and its CUDA context lies outside torch's allocator, so the allocator is
capped at the share less the context's allowance: ``torch.cuda.set_per_process_memory_fraction`` then makes an
allocation past it fail in that role (an out-of-memory error naming the cap) instead of taking a neighbour's
memory. A vLLM rollout gets no torch cap: the config hands its share to vLLM as ``rollout.gpu_memory_utilization``
(with ``rollout.kv_cache_mib`` set, vLLM sizes its cache by that and checks the share against the memory free at
its start). On a CPU nothing is capped, and the role's log says so.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from services.common.config import ConfigError, Role, RunConfig
from services.common.model.device import device_name
from services.common.observe.events import Event
from services.common.observe.logs import log_event

log = logging.getLogger(__name__)
# What a process's CUDA context takes on the device before its first tensor: about 500 MiB on H100-class GPUs with
# CUDA's lazy module loading (more without it). `rlpipe plan` adds it to every process's budget.
CUDA_CONTEXT_BYTES = 512 * 2**20
# What torch's allocator holds in any process that computes on the GPU, beyond the tensors `rlpipe plan` estimates:
# cuBLAS's workspace (32 MiB per stream on Hopper, drawn from the allocator), the allocator's rounding of blocks to
# 2 MiB and 20 MiB segments, and the small fixed tensors no estimate counts. A tiny model's share would otherwise
# cap its allocator at tens of MiB, under that floor.
ALLOCATOR_FLOOR_BYTES = 256 * 2**20


@dataclass(frozen=True)
class GpuShare:
    """What a role's process does with its share: the allocator cap it applies, or why it applies none."""

    role: str
    share: float | None  # service.gpu_memory_fraction's entry for the role; None = not set
    allocator_fraction: float | None  # the cap given to torch; None = no cap
    reason: str  # why no cap, or what the cap is
    under_floor: bool = False  # the cap is under ALLOCATOR_FLOOR_BYTES: the role will likely run out of memory


def allocator_fraction(share: float, total_bytes: int, role: str, context_bytes: int = CUDA_CONTEXT_BYTES) -> float:
    """The fraction of the device torch's allocator may hold: ``(share x total - context) / total``.

    Raises ConfigError naming ``service.gpu_memory_fraction.<role>`` when the share does not even cover a CUDA
    context on this GPU."""
    allowed = share * total_bytes - context_bytes
    if allowed <= 0:
        raise ConfigError(
            f"invalid configuration:\n  service.gpu_memory_fraction.{role}: {share:g} of this GPU's "
            f"{total_bytes / 2**30:.1f} GiB is {share * total_bytes / 2**20:.0f} MiB, not even a CUDA context's "
            f"{context_bytes / 2**20:.0f} MiB: raise it"
        )
    return allowed / total_bytes


def torch_device_setting(cfg: RunConfig, role: str) -> str | None:
    """The device setting of the torch model ``role`` computes with in this process; None where it has none to
    cap: a vLLM rollout (vLLM keeps to rollout.gpu_memory_utilization) or a reward without a reward model."""
    if role == "rollout" and cfg.rollout.backend == "vllm":
        return None
    if role == "reward":
        return cfg.reward.model.device if cfg.reward.model is not None else None
    return cfg.model.device


def decide_share(cfg: RunConfig, role: Role, cuda_available: bool, total_bytes: Callable[[], int]) -> GpuShare:
    """What ``role`` caps, given whether this process sees a GPU and (asked only when a cap is due) that GPU's
    memory in bytes."""
    share = cfg.service.gpu_memory_fraction.get(role)
    if share is None:
        return GpuShare(role, None, None, "no share set: torch's allocator is not capped")
    setting = torch_device_setting(cfg, role)
    if setting is None:
        why = "vLLM keeps to rollout.gpu_memory_utilization" if role == "rollout" else "no torch model on a device"
        return GpuShare(role, share, None, f"not applied: {why}")
    if device_name(setting, cuda_available) != "cuda":
        return GpuShare(role, share, None, "not applied: this role computes on the CPU")
    total = total_bytes()
    fraction = allocator_fraction(share, total, role)
    reason = f"torch's allocator capped at {fraction:.4f} of {total / 2**30:.1f} GiB"
    if under := fraction * total < ALLOCATOR_FLOOR_BYTES:
        reason += (
            f", {fraction * total / 2**20:.0f} MiB: under the {ALLOCATOR_FLOOR_BYTES // 2**20} MiB torch holds "
            f"whatever the model (cuBLAS's workspace, segment rounding); raise service.gpu_memory_fraction.{role}"
        )
    return GpuShare(role, share, fraction, reason, under)


def apply_gpu_share(cfg: RunConfig, role: Role) -> GpuShare:
    """Cap this process's torch allocator at ``role``'s share of its first GPU (device 0 of what
    CUDA_VISIBLE_DEVICES leaves it) and log what was done, or that nothing was (a CPU, a vLLM rollout); silent
    without a share. Raises ConfigError naming the field for a share too small for this GPU."""
    share = cfg.service.gpu_memory_fraction.get(role)
    if share is None:
        return GpuShare(role, None, None, "no share set: torch's allocator is not capped")
    torch = sys.modules.get("torch")
    if torch is None:  # a rule-only reward replica: nothing of it is on a device
        decided = GpuShare(role, share, None, "not applied: no torch model in this process")
    else:
        decided = decide_share(
            cfg, role, torch.cuda.is_available(), lambda: torch.cuda.get_device_properties(0).total_memory
        )
        if decided.allocator_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(decided.allocator_fraction, 0)
    log_event(
        log,
        Event.GPU_MEMORY_SHARE,
        level=logging.WARNING if decided.under_floor else logging.INFO,
        share=decided.share,
        allocator_fraction=decided.allocator_fraction,
        reason=decided.reason,
    )
    return decided
