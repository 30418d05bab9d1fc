"""A stand-in for nvidia-ml-py's ``pynvml``, the NVML boundary: two GPUs with a fixed load and memory use.

Loaded in place of the real bindings (tests/common/test_hardware.py), or put first on PYTHONPATH so a role
process started by a test imports it (tests/common/test_service.py): there is no GPU on CI, and NVML is the
one thing faked. Only the calls rlpipe makes are here; tests replace a function to make it fail.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

GIB = 2**30
# (uuid, utilisation %, memory used, memory total) per device, in NVML's order.
GPUS = [
    ("GPU-00000000-0000-0000-0000-00000000000a", 87, 100 * GIB, 140 * GIB),
    ("GPU-00000000-0000-0000-0000-00000000000b", 3, 7 * GIB, 80 * GIB),
]


class NVMLError(Exception):
    pass


def nvmlInit() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(GPUS)


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= index < len(GPUS):
        raise NVMLError(f"no device {index}")
    return index


def nvmlDeviceGetHandleByUUID(uuid: str) -> int:
    for index, (known, *_) in enumerate(GPUS):
        if known == uuid:
            return index
    raise NVMLError(f"no device {uuid}")


def nvmlDeviceGetUUID(handle: int) -> str:
    return GPUS[handle][0]


def nvmlDeviceGetUtilizationRates(handle: int) -> SimpleNamespace:
    return SimpleNamespace(gpu=GPUS[handle][1], memory=0)


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    _, _, used, total = GPUS[handle]
    return SimpleNamespace(used=used, total=total, free=total - used)


# Per device index: (pid, device memory it uses in bytes, or None where NVML cannot tell) of each compute process.
# Empty unless a test puts processes there; no process ever holds a graphics context here.
PROCESSES: dict[int, list[tuple[int, int | None]]] = {}
# A process started with FAKE_NVML_SELF_MIB set (a role a test starts) is listed on device 0 as using that much.
SELF_MIB = os.environ.get("FAKE_NVML_SELF_MIB")


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[SimpleNamespace]:
    listed = list(PROCESSES.get(handle, []))
    if SELF_MIB is not None and handle == 0:
        listed.append((os.getpid(), int(SELF_MIB) * 2**20))
    return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in listed]


def nvmlDeviceGetGraphicsRunningProcesses(handle: int) -> list[SimpleNamespace]:
    return []
