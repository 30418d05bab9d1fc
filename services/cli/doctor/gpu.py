"""``rlpipe doctor``'s GPU rows: pure decisions over the facts services/common/observe/hardware.py gathers, so each
branch is tested on a machine without a GPU by handing it the facts of one (tests/cli/doctor/test_gpu.py)."""

from __future__ import annotations

from services.common.observe.hardware import GpuFacts, release_numbers
from services.common.startup_checks.machine import cuda_failure
from services.common.startup_checks.rows import CheckResult, Status


def gpu_row(facts: GpuFacts) -> CheckResult:
    """A GPU the driver shows but CUDA cannot open fails, naming why: CUDA code would run on the CPU or not at all."""
    if not facts.cuda_available:
        if not facts.gpu_seen:
            return CheckResult("gpu", "ok", f"no GPU (CPU run), torch {facts.torch_version}")
        return CheckResult(
            "gpu", "fail", f"a GPU is present ({facts.gpu_seen}) but CUDA does not initialize: {cuda_failure(facts)}"
        )
    names = facts.devices
    devices = f"{len(names)}x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    driver = facts.driver_version or "unknown"
    return CheckResult("gpu", "ok", f"{devices}; torch {facts.torch_version}, CUDA {facts.torch_cuda}, driver {driver}")


def cuda_versions_row(facts: GpuFacts) -> CheckResult:
    """torch's CUDA against the newest CUDA the driver supports.

    An older driver major cannot run the build at all; an older minor of the same major runs
    through CUDA's minor-version compatibility, where code JIT-compiled from PTX (Triton's
    kernels, vLLM's) can still fail, hence a warning.
    """
    if not facts.cuda_available and not facts.gpu_seen:
        return CheckResult("cuda", "skip", "no GPU")
    if facts.torch_cuda is None:
        return CheckResult("cuda", "skip", f"torch {facts.torch_version} is a CPU-only build (see gpu)")
    built = f"torch {facts.torch_version} is built for CUDA {facts.torch_cuda}"
    if facts.driver_cuda is None:
        return CheckResult(
            "cuda", "warn", f"{built}; the driver's CUDA version is unknown (NVML did not load, nvidia-smi did not say)"
        )
    driver = f"driver {facts.driver_version or '(version unknown)'} supports CUDA up to {facts.driver_cuda}"
    want, have = release_numbers(facts.torch_cuda)[:2], release_numbers(facts.driver_cuda)[:2]
    if have[:1] < want[:1]:
        return CheckResult(
            "cuda",
            "fail",
            f"{built} but the {driver}: upgrade the driver, or install a torch built for CUDA {have[0]}.x",
        )
    if have < want:
        return CheckResult(
            "cuda",
            "warn",
            f"{built} but the {driver}: it runs by minor-version compatibility, and kernels compiled at run time "
            "(Triton, vLLM) may fail; upgrade the driver",
        )
    return CheckResult("cuda", "ok", f"{built}; {driver}")


def nccl_row(facts: GpuFacts) -> CheckResult:
    """The NCCL torch loaded: present (needed with more than one GPU), for torch's CUDA major, and the wheel's own."""
    if not facts.cuda_available:
        return CheckResult("nccl", "skip", "no CUDA")
    if facts.nccl is None:
        # One GPU trains without NCCL; more than one cannot share gradients.
        status: Status = "warn" if len(facts.devices) <= 1 else "fail"
        return CheckResult("nccl", status, f"NCCL unavailable: {facts.nccl_error[:120]}")
    if facts.nccl_wheel is None:
        return CheckResult("nccl", "ok", f"NCCL {facts.nccl} (no nvidia-nccl wheel: linked into torch or the system's)")
    wheel, wheel_version = facts.nccl_wheel
    wheel_cuda = int(wheel.removeprefix("nvidia-nccl-cu"))  # gpu_facts matched nvidia-nccl-cu<digits>
    torch_major = release_numbers(facts.torch_cuda or "")[:1]
    if torch_major and wheel_cuda != torch_major[0]:
        return CheckResult(
            "nccl",
            "fail",
            f"{wheel} {wheel_version} is built for CUDA {wheel_cuda} but torch for CUDA {facts.torch_cuda}: "
            f"install nvidia-nccl-cu{torch_major[0]}",
        )
    if release_numbers(wheel_version)[:3] != release_numbers(facts.nccl)[:3]:
        return CheckResult(
            "nccl",
            "warn",
            f"torch loaded NCCL {facts.nccl} but {wheel} is {wheel_version}: another libnccl "
            "(LD_LIBRARY_PATH, a system install) shadows the wheel's",
        )
    return CheckResult("nccl", "ok", f"NCCL {facts.nccl} ({wheel} {wheel_version})")


def vllm_row(facts: GpuFacts) -> CheckResult:
    """The torch vLLM was built against is the torch installed: its compiled ops load against no other."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if facts.vllm is None:
        return CheckResult("vllm", "skip", "vLLM is not installed (the rollout needs it: the vllm extra)")
    dist, version = facts.vllm
    if not facts.vllm_torch:
        return CheckResult("vllm", "ok", f"{dist} {version} names no torch requirement on this platform")
    try:
        wanted = SpecifierSet(facts.vllm_torch)
    except InvalidSpecifier:
        return CheckResult("vllm", "warn", f"{dist} {version} requires torch {facts.vllm_torch!r}, which is unreadable")
    if not wanted.contains(facts.torch_version, prereleases=True):
        return CheckResult(
            "vllm",
            "fail",
            f"{dist} {version} requires torch{facts.vllm_torch} but torch {facts.torch_version} is installed: "
            "install the torch it pins (requirements.lock; deploy/requirements-cuda.txt on a GPU machine)",
        )
    return CheckResult(
        "vllm", "ok", f"{dist} {version} requires torch{facts.vllm_torch}; torch {facts.torch_version} is installed"
    )


def gpu_rows(facts: GpuFacts) -> list[CheckResult]:
    return [gpu_row(facts), cuda_versions_row(facts), nccl_row(facts), vllm_row(facts)]
