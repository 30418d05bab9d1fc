"""The GPU memory one role's process holds, as torch and NVML see it.

Three figures, each absent where its source is:

  allocated   torch: bytes held by live tensors, over the CUDA devices this process initialized
  reserved    torch: bytes its caching allocator holds, the live tensors' and the freed blocks it keeps for reuse
  used        NVML: device memory of this process and its children (a vLLM worker, torchrun's ranks), its CUDA
              context included, as ``nvidia-smi`` lists it per process

``reserved - allocated`` is what the caching allocator keeps without using; ``used - reserved`` is mostly CUDA
contexts and libraries' workspaces (cuBLAS, NCCL), which torch's allocator does not see. A process that has not
initialized CUDA has no torch figures (reading them must not create a context), and without NVML, or where NVML
cannot see the process (some containers), there is no ``used``.

Every role reports them in its presence entry (``gpu_memory``, GiB; the trainer sums them per role into its step
rows as ``memory/<role>/<figure>_gb`` and ``rlpipe status`` shows them) and on its Prometheus endpoint as
``rlpipe_role_gpu_memory_bytes{role,kind}`` (instruments.watch_gpu_memory).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

from services.common.observe import metrics as m
from services.common.observe.records import MetricsRow
from services.common.observe.usage import GpuHold, gpu_holders, with_descendants

GIB = 2**30
KINDS = ("allocated", "reserved", "used")
# The roles whose memory the trainer's step rows carry (m.ROLE_GPU_MEMORY).
ROLES = ("trainer", "rollout", "reward", "reference")


@dataclass(frozen=True)
class CudaMemory:
    """What torch's allocator says, summed over this process's CUDA devices (bytes)."""

    allocated: int
    reserved: int


@dataclass(frozen=True)
class ProcessGpuMemory:
    """One process's GPU memory (bytes); None where the source is missing."""

    allocated: int | None = None
    reserved: int | None = None
    used: int | None = None

    def gib(self) -> dict[str, float]:
        """``{"allocated_gb": ..., "reserved_gb": ..., "used_gb": ...}``, the figures that are known, in GiB."""
        figures = {"allocated": self.allocated, "reserved": self.reserved, "used": self.used}
        return {f"{kind}_gb": round(value / GIB, 4) for kind, value in figures.items() if value is not None}


def torch_cuda_memory() -> CudaMemory | None:
    """torch's allocator counters of this process; None where torch is not imported or CUDA not initialized here
    (asking would initialize it, and a CUDA context costs the GPU hundreds of MiB)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    devices = range(torch.cuda.device_count())
    return CudaMemory(
        sum(torch.cuda.memory_allocated(i) for i in devices), sum(torch.cuda.memory_reserved(i) for i in devices)
    )


def process_gpu_memory(
    pid: int,
    cuda: Callable[[], CudaMemory | None] = torch_cuda_memory,
    holders: Callable[[], dict[int, GpuHold]] = gpu_holders,
) -> ProcessGpuMemory:
    """The GPU memory of process ``pid`` (this one, for ``cuda``'s figures) and its children; ``cuda`` and
    ``holders`` are where the figures come from (torch's counters, NVML's processes), for tests to replace."""
    counters = cuda()
    held = holders()
    found = [held[p].mem_gib for p in with_descendants(pid) if p in held]
    # NVML says None where it cannot tell a process's memory: then no sum rather than a short one.
    known = [gib for gib in found if gib is not None]
    used = None if not found or len(known) < len(found) else round(sum(known) * GIB)
    if counters is None:
        return ProcessGpuMemory(used=used)
    return ProcessGpuMemory(counters.allocated, counters.reserved, used)


def role_memory(step_rows: list[MetricsRow]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """role -> figure (allocated, reserved, used) -> (step, GiB) of each step row that carries it."""
    found: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for row in step_rows:
        for (role, kind), value in row.family(m.ROLE_GPU_MEMORY).items():
            if role in ROLES and kind in KINDS and math.isfinite(value) and row.step is not None:
                found.setdefault(role, {}).setdefault(kind, []).append((row.step, value))
    return {role: found[role] for role in ROLES if role in found}  # in ROLES' order, whatever the rows' own


def memory_lines(step_rows: list[MetricsRow]) -> list[tuple[str, str]]:
    """(quantity, value) rows for the report: each role's GPU memory, peak and last, per figure; none on a CPU."""
    lines = []
    for role, figures in role_memory(step_rows).items():
        said = [
            f"{kind} peak {max(gib for _, gib in points):.2f}, last {points[-1][1]:.2f}"
            for kind in KINDS
            if (points := figures.get(kind))
        ]
        lines.append((f"GPU GiB: {role}", "; ".join(said)))
    return lines
