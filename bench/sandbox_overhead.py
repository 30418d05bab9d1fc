"""What the Python tool's box costs per call: the box against the plain child process the tool used before it, against
the same box without its system-call filter, and against the box's own unisolated fallback, in one run, calls
interleaved so a busy machine weighs on all alike.

    python -m bench.sandbox_overhead [--calls 30] [--code "print(sum(range(10)))"]

The old tool (kept here as the baseline): ``python -I -c BOOT code`` with the rollout's own interpreter (its virtual
environment's site-packages), rlimits set by the child itself, the code exec'd in that process, one process group.
Prints one JSON line: per kind the median, lowest and highest wall time of a call and the median CPU time of its
processes (the caller's children as it reaped them; every process of a box is reaped by its parent, so the CPU counts
them all, and a busy machine changes it less than it changes the wall time), and the box's medians over the
baseline's and over the unfiltered box's (what the seccomp filter adds: building its program on the caller's side,
installing it, and running it on each of the code's system calls).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from services.common.episodes.environments import PYTHON_LIMITS
from services.common.sandbox import Box

LIMITS = PYTHON_LIMITS
OLD_BOOT = (
    "import resource as r, sys\n"
    f"r.setrlimit(r.RLIMIT_AS, ({LIMITS.address_space_bytes}, {LIMITS.address_space_bytes}))\n"
    f"r.setrlimit(r.RLIMIT_CPU, ({LIMITS.cpu_s}, {LIMITS.cpu_s}))\n"
    f"r.setrlimit(r.RLIMIT_FSIZE, ({LIMITS.file_bytes}, {LIMITS.file_bytes}))\n"
    f"r.setrlimit(r.RLIMIT_NOFILE, ({LIMITS.open_files}, {LIMITS.open_files}))\n"
    "code = sys.argv.pop(1)\n"
    "exec(compile(code, '<tool>', 'exec'), {'__name__': '__main__'})\n"
)


def old_subprocess(code: str) -> str:
    """The tool before the box, as it ran a call (files for the output, killed by process group at the end)."""
    with tempfile.TemporaryDirectory(prefix="rlpipe-python-") as folder:
        out, err = (open(Path(folder) / name, "w+b") for name in (".stdout", ".stderr"))  # noqa: SIM115
        with out, err:
            child = subprocess.Popen(
                [sys.executable, "-I", "-c", OLD_BOOT, code],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=folder,
                env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
            )
            try:
                child.wait(timeout=LIMITS.time_s)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            out.seek(0)
            return out.read().decode()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30, help="calls of each kind")
    parser.add_argument("--code", default="print(sum(range(10)))")
    args = parser.parse_args(argv)
    kinds: dict[str, Callable[[str], str]] = {
        "old_subprocess": old_subprocess,
        "box": lambda code: Box(LIMITS).run(code).stdout,
        "box_unfiltered": lambda code: Box(LIMITS, syscall_filter=False).run(code).stdout,
        "unisolated": lambda code: Box(LIMITS, isolated=False).run(code).stdout,
    }
    expected = old_subprocess(args.code)
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.calls):
        for kind, call in kinds.items():
            before, start = children_cpu_s(), time.perf_counter()
            printed = call(args.code)
            seconds[kind].append(time.perf_counter() - start)
            cpu[kind].append(children_cpu_s() - before)
            assert printed == expected, f"{kind} printed {printed!r}, not {expected!r}"
    row = {
        kind: {
            "median_ms": statistics.median(seconds[kind]) * 1e3,
            "min_ms": min(seconds[kind]) * 1e3,
            "max_ms": max(seconds[kind]) * 1e3,
            "cpu_median_ms": statistics.median(cpu[kind]) * 1e3,
        }
        for kind in kinds
    }
    ratios = {
        f"{kind}_over_old{suffix}": round(statistics.median(of[kind]) / statistics.median(of["old_subprocess"]), 2)
        for kind in ("box", "box_unfiltered", "unisolated")
        for suffix, of in (("", seconds), ("_cpu", cpu))
    }
    ratios |= {
        f"box_over_unfiltered{suffix}": round(statistics.median(of["box"]) / statistics.median(of["box_unfiltered"]), 2)
        for suffix, of in (("", seconds), ("_cpu", cpu))
    }
    rounded = {kind: {name: round(value, 1) for name, value in stats.items()} for kind, stats in row.items()}
    print(json.dumps({"calls": args.calls, "cpus": os.cpu_count(), **rounded, **ratios}))


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
