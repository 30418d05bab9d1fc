"""A trial's processes, found by process group in /proc.

Each trial's ``rlpipe run`` starts a session of its own, so the launcher's pid is the group id of
the launcher, nats-server and every service it starts (they do not call setsid). Memory is summed
over that group; stopping a trial signals the group, so a service that outlives its launcher is
stopped too. Linux only, like the launcher's PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.observe.hardware import nvml_or

PROC = Path("/proc")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn of a trial's launcher: killed (SIGKILL) when the tuner dies, so nothing is left behind.

    The launcher does the same for its services, so a SIGKILLed tuner takes the whole tree down; a
    restarted tuner still kills the recorded process group in case anything escaped.
    """
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True)
class Member:
    pid: int
    rss_bytes: int
    state: str


def _stat(pid_dir: Path) -> tuple[int, str, int] | None:
    """(pgid, state, rss pages) from /proc/<pid>/stat, or None if it vanished."""
    try:
        text = (pid_dir / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[2]), fields[0], int(fields[21])


def group_members(pgid: int) -> list[Member]:
    """Live processes of process group ``pgid`` (zombies excluded: they hold no memory and are being reaped)."""
    members = []
    for pid_dir in PROC.iterdir():
        if not pid_dir.name.isdigit():
            continue
        stat = _stat(pid_dir)
        if stat is None or stat[0] != pgid or stat[1] == "Z":
            continue
        members.append(Member(int(pid_dir.name), stat[2] * _PAGE, stat[1]))
    return members


def group_rss_bytes(pgid: int) -> int:
    return sum(m.rss_bytes for m in group_members(pgid))


def group_cmdlines(pgid: int) -> list[str]:
    out = []
    for member in group_members(pgid):
        try:
            out.append((PROC / str(member.pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
        except OSError:
            continue
    return out


def environ_value(pid: int, key: str) -> str | None:
    """``key`` in the environment process ``pid`` was started with (the kernel's copy), None if unset or gone."""
    try:
        entries = (PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{key}=".encode()
    return next((e[len(prefix) :].decode() for e in entries if e.startswith(prefix)), None)


class GpuMemory:
    """Device memory used by a set of pids, from NVML; ``available`` is False without nvidia-ml-py or a driver."""

    def __init__(self) -> None:
        self.available = False
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no package, no driver, no device: the GPU limit cannot be enforced, and says so
            return
        self._nvml = pynvml
        self.available = True
        self.device_count = pynvml.nvmlDeviceGetCount()

    def used_bytes(self, pids: set[int]) -> int:
        if not self.available:
            return 0
        nvml, total = self._nvml, 0
        for index in range(self.device_count):
            handle = nvml_or(nvml, None, nvml.nvmlDeviceGetHandleByIndex, index)
            if handle is None:
                continue
            for proc in nvml_or(nvml, [], nvml.nvmlDeviceGetComputeRunningProcesses, handle):
                if proc.pid in pids and proc.usedGpuMemory:
                    total += proc.usedGpuMemory
        return total


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pgid, sig)


def kill_group(pgid: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL the group and wait until none of it is alive; returns pids still there after ``timeout_s``."""
    signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while (members := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [m.pid for m in members]
