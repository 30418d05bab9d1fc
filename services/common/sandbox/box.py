"""The caller's side of the box: what it binds, its limits, one run of code, and the probe a service starts with."""

from __future__ import annotations

import contextlib
import marshal
import os
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from services.common.sandbox import seccomp

# The system's programs and libraries, read-only (missing ones are left out; /bin -> usr/bin stays a link).
SYSTEM_BINDS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/ld.so.cache",
    "/etc/localtime",
)
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
BOOT = (Path(__file__).parent / "boot.py").read_text()
# How long a box killed at its time limit is given to be gone (SIGKILL: milliseconds, unless the machine is loaded).
INIT_EXIT_WAIT_S = 5.0
# How long a probe may take to build a box and run one print (a loaded machine starts interpreters slowly).
PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class BoxLimits:
    """What one run may spend. ``processes``, ``tmp_bytes``: in the box only (unisolated, a per-user process count
    would count the caller's own threads)."""

    time_s: float = 5.0  # wall clock, then the whole box is killed
    address_space_bytes: int = 512 << 20  # per process
    cpu_s: int = 6  # per process
    file_bytes: int = 1 << 20  # any one file, the output included (read back whole: keep it small)
    open_files: int = 64  # per process
    processes: int = 16  # processes and threads of the box's user: its builder, init and the code's first included
    tmp_bytes: int = 16 << 20  # the private /tmp (memory)


@dataclass(frozen=True)
class Outcome:
    """How one run ended: its exit status, or the signal that killed it, or the time limit; and what it wrote."""

    stdout: str
    stderr: str
    exit_status: int | None = None
    signal: int | None = None
    timed_out: bool = False
    isolated: bool = True


@dataclass(frozen=True)
class BoxSpec:
    """What ``boot.py`` is told, marshalled: whether to build the box, who its parent is (it dies with it), where its
    status goes, the interpreter, the empty folder its root is mounted on, what it binds, its limits and the
    seccomp program the code runs under (``seccomp.program``; empty: none)."""

    isolate: bool
    parent: int
    status_fd: int
    executable: str
    root: str
    binds: list[str]
    devices: list[str]
    limits: BoxLimits
    syscall_filter: bytes


class BoxFailed(RuntimeError):
    """The box could not be built, or ended without saying how the code ended: not the code's fault."""


def interpreter() -> str:
    """The interpreter behind this one (a virtual environment's base): the box holds no virtual environment."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def interpreter_binds() -> list[str]:
    """The system folders, plus the interpreter's install where it lies outside them (a pyenv or uv Python)."""
    binds: list[str] = list(SYSTEM_BINDS)
    for folder in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(interpreter())):
        real = os.path.realpath(folder)
        if real != "/" and not any(real == b or real.startswith(b.rstrip("/") + "/") for b in binds):
            binds.append(real)
    return binds


class Box:
    """Runs Python code in a box (``isolated``), or in a plain child process where a config allows no box.

    Isolated, the code runs as ``nobody`` in new user, PID, network, mount, IPC and UTS namespaces: its root is a
    read-only tmpfs holding read-only binds of the system's libraries and the interpreter, five device nodes and
    a private ``/tmp`` tmpfs; no /proc, /sys, home, run directory or checkout; only a loopback interface; no
    capability; an empty environment; rlimits on address space, CPU time, file size, open files and processes; a
    seccomp filter (``seccomp.py``) that refuses namespaces, mounts, tracing, BPF, io_uring, keyrings and the rest
    of the kernel's surface the code has no use for, and kills a call through another ABI. At the time limit, or
    when the code's main process ends, the PID namespace's init ends and the kernel kills every process in it.
    Unisolated: the same limits but the process count, a fresh folder, an empty environment and the process group
    killed at the end; the file system, the network and /proc are open, and no filter is installed.
    ``syscall_filter=False`` builds the box without its filter: only for the tests and the bench that show what
    the filter stops and what it costs (no config reaches it)."""

    def __init__(self, limits: BoxLimits = BoxLimits(), isolated: bool = True, syscall_filter: bool = True):
        self.limits = limits
        self.isolated = isolated
        self.syscall_filter = syscall_filter

    def run(self, code: str) -> Outcome:
        """Run ``code`` once; its outcome, or BoxFailed when the box could not run it."""
        program = b""
        if self.isolated and self.syscall_filter:
            try:
                program = seccomp.program(os.uname().machine)
            except seccomp.Unsupported as error:  # no weaker box: none, as where namespaces are refused
                raise BoxFailed(f"cannot build the box: {error}") from None
        with tempfile.TemporaryDirectory(prefix="rlpipe-box-") as folder:
            (Path(folder) / "root").mkdir()  # the box's root is mounted here, in its own mount namespace only
            (Path(folder) / "work").mkdir()  # unisolated, the code's working folder
            out, err, status = (open(Path(folder) / name, "w+b") for name in ("stdout", "stderr", "status"))  # noqa: SIM115
            with out, err, status:
                spec = BoxSpec(
                    isolate=self.isolated,
                    parent=os.getpid(),
                    status_fd=status.fileno(),
                    executable=interpreter(),
                    root=str(Path(folder, "root")),
                    binds=interpreter_binds(),
                    devices=list(DEVICES),
                    limits=self.limits,
                    syscall_filter=program,
                )
                try:
                    starter = subprocess.Popen(
                        [interpreter(), "-I", "-S", "-c", BOOT, marshal.dumps(asdict(spec)).hex(), code],
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        pass_fds=(status.fileno(),),
                        cwd=Path(folder, "work"),
                        env={},  # nothing of the caller's environment (tokens, key files) from the first process on
                        start_new_session=True,
                    )
                except OSError as error:  # no interpreter to start, no process to spare
                    raise BoxFailed(f"cannot start the box's interpreter {interpreter()}: {error}") from None
                try:
                    returncode = starter.wait(timeout=self.limits.time_s)
                except subprocess.TimeoutExpired:
                    returncode = None
                finally:
                    # The starter's group holds the builder and the box's init: init's end ends the box.
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(starter.pid, signal.SIGKILL)
                    starter.wait()
                stdout, stderr, said = (read_back(stream, self.limits.file_bytes) for stream in (out, err, status))
                if returncode is None:
                    wait_for_init(said)
        return self._outcome(returncode, stdout, stderr, said)

    def _outcome(self, returncode: int | None, stdout: str, stderr: str, said: str) -> Outcome:
        if returncode is None:
            return Outcome(stdout, stderr, timed_out=True, isolated=self.isolated)
        ends = [line for line in said.splitlines() if line.partition(" ")[0] in ("exit", "signal", "setup")]
        kind, _, detail = (ends or [""])[-1].partition(" ")
        if kind == "exit" and detail.isdigit():
            return Outcome(stdout, stderr, exit_status=int(detail), isolated=self.isolated)
        if kind == "signal" and detail.isdigit():
            return Outcome(stdout, stderr, signal=int(detail), isolated=self.isolated)
        if kind == "setup":
            raise BoxFailed(f"cannot build the box: {detail}")
        last = (stderr.strip().splitlines() or [f"exit status {returncode}"])[-1]
        raise BoxFailed(f"the box ended without saying how its code ended ({last[:300]})")


def wait_for_init(said: str) -> None:
    """Wait until the box's init, killed with its group, has ended: the kernel has then killed every other process
    of its PID namespace (init's end waits for theirs). Without this a call killed at its time limit could return
    a few milliseconds before the last of them is gone."""
    pids = [line.split()[1] for line in said.splitlines() if line.startswith("init ") and line.split()[1].isdigit()]
    if not pids:
        return  # killed before it had an init, or unisolated
    try:
        descriptor = os.pidfd_open(int(pids[-1]))
    except ProcessLookupError:
        return  # gone already
    try:
        poller = select.poll()
        poller.register(descriptor, select.POLLIN)
        poller.poll(INIT_EXIT_WAIT_S * 1000)
    finally:
        os.close(descriptor)


def read_back(stream, limit: int) -> str:
    stream.seek(0)
    return stream.read(limit).decode(errors="replace")


def probe(limits: BoxLimits = BoxLimits(time_s=PROBE_TIMEOUT_S)) -> str | None:
    """None when a box can be built here (one is, and runs a print); else why not, in a sentence."""
    if not sys.platform.startswith("linux"):
        return f"the box needs Linux namespaces; this is {sys.platform}"
    try:
        outcome = Box(limits).run("print('ok')")
    except BoxFailed as error:
        return str(error)
    if outcome.timed_out:
        return f"a trial box did not run a print within {limits.time_s:g}s"
    if (outcome.exit_status, outcome.stdout.strip()) != (0, "ok"):
        return f"a trial box's print ended with {outcome} instead of printing ok"
    return None
