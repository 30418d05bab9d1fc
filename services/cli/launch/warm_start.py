"""Warm starts: the launcher's roles forked from one process that has imported their libraries once.

A role is a Python process that imports torch, transformers and, for a vLLM rollout, vLLM before it does anything:
6 to 10 CPU seconds each on this machine, paid by every role of a run and again at every restart, which on a few
cores makes start-up a queue of interpreters importing the same files. The warm starter is one process that imports
them once (``python -m services.cli.launch.warm_start``) and then forks a child for each role the launcher asks for. The
child becomes what ``python -m services.<role> ARGS`` would have been: its own arguments, environment, working
folder and output pipe, its role module run as ``__main__``, its exit status its own. It is as real a process as a
cold start (its own pid, in run.json, signalled and SIGKILLed as before) and dies with the launcher, since the
warm starter does and each child dies with it.

Fork safety, which the preload must keep: the warm starter runs no Python thread and computes nothing (no torch
op, so no OpenMP pool exists to be lost across the fork), and it refuses to fork once CUDA has been initialised in
it. Only imports run before a fork; the roles' own state (config, logging, connections, models) is built after it.
``service.warm_start: false`` starts every role as a fresh interpreter instead.

A warm-start pool (``service.warm_start_pool``) shares the imports between runs on one machine: tuning trials
one after another, a test suite's runs. ``python -m services.cli.launch.warm_start --listen SOCKET MODULES...`` imports
once and forks a *session* for each launcher that connects; the session is what a run's own warm starter would
be (it forks that run's roles, reports their exits, and ends when its launcher closes the channel or dies, its
roles with it). Sessions and roles die with the pool too, and a run whose pool is gone starts its roles cold.

Protocol, over a SOCK_SEQPACKET socket pair (one JSON message per packet): a pool's session first says
``{"session": pid}``; then the launcher sends
``{"module", "args", "env", "cwd"}`` with the write end of the child's output pipe attached (SCM_RIGHTS); the warm
starter answers ``{"spawned": pid}``, and later ``{"exited": pid, "code": c}`` (``c`` negative for a signal, as
subprocess reports it) when it has reaped the child.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from services.common.parent_death import die_with_parent

# Imported before the first fork: every role's own modules and the libraries they pull in. vLLM only where a
# rollout runs on it (``preload_modules``); a rule-reward replica that never imports torch costs nothing more
# forked, since the pages are shared with the warm starter.
ROLE_MODULES = (
    "services.trainer.role",
    "services.reference.service",
    "services.rollout.service",
    "services.reward.service",
)
# vLLM's package imports little until its LLM class is asked for; that class's module brings the engine, scheduler
# and model-loading code, 4 to 5 of the 8 CPU s a rollout spent building its engine after the fork.
VLLM_MODULES = ("vllm", "vllm.entrypoints.llm")
MESSAGE_BYTES = 1 << 20  # one request: the environment and arguments of a role
SPAWN_TIMEOUT_S = 600.0  # the first request waits for the imports, which a loaded machine can stretch to minutes


def preload_modules(vllm_rollout: bool) -> list[str]:
    return [*ROLE_MODULES, *(VLLM_MODULES if vllm_rollout else ())]


@dataclass(frozen=True)
class SpawnRequest:
    module: str  # run as ``python -m module``
    args: list[str]
    env: dict[str, str]
    cwd: str


class WarmStartError(RuntimeError):
    """The warm starter could not start a role (it died, or never finished its imports)."""


class WarmProcess:
    """A role forked by the warm starter, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, starter: WarmStarter, pid: int, args: list[str], stdout: IO[bytes]):
        self.starter = starter
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.starter.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.starter.wait_for_news(min(remaining, 0.5) if remaining is not None else 0.5)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """The launcher's end: starts the warm starter, asks it for children, learns their exits."""

    def __init__(self, channel: socket.socket, process: subprocess.Popen | PoolSession, where: str):
        self.channel = channel
        self.process = process  # the warm starter, or this run's session of a pool
        self.where = where  # where to look when it fails: its log, or the pool's socket
        self.exits: dict[int, int] = {}  # pid -> exit code, as reported
        self.gone = False  # the warm starter died: its children died with it
        self.lock = threading.Lock()

    @classmethod
    def start(cls, modules: list[str], env: dict[str, str], log_path: Path, on_start=None) -> WarmStarter:
        """A warm starter of this run's own, importing ``modules`` (its output in ``log_path``)."""
        channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "services.cli.launch.warm_start", str(theirs.fileno()), *modules],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=[theirs.fileno()],
                preexec_fn=on_start,
            )
        theirs.close()
        return cls(channel, process, f"see {log_path}")

    @classmethod
    def join(cls, pool: Path) -> WarmStarter:
        """A session of the warm-start pool listening at ``pool``; WarmStartError if there is none."""
        where = f"the warm-start pool at {pool}"
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            channel.connect(str(pool))
            if not _same_user(channel):  # it would be handed the roles' credentials
                channel.close()
                raise WarmStartError(f"{where} runs as another user: not joined")
            # The pool may still be importing: it accepts once it is done.
            answered = select.select([channel], [], [], SPAWN_TIMEOUT_S)[0]
            hello = json.loads(channel.recv(MESSAGE_BYTES) or b"{}") if answered else {}
        except (OSError, ValueError) as error:
            channel.close()
            raise WarmStartError(f"cannot join {where}: {error}") from error
        if "session" not in hello:
            channel.close()
            why = "closed the connection" if answered else f"did not answer within {SPAWN_TIMEOUT_S:.0f} s"
            raise WarmStartError(f"{where} {why} before starting a session")
        return cls(channel, PoolSession(int(hello["session"])), where)

    @property
    def alive(self) -> bool:
        return not self.gone and self.process.poll() is None

    def spawn(self, command: list[str], env: dict[str, str]) -> WarmProcess:
        """Start ``command`` (``python -m MODULE ARGS...``) as a child of the warm starter."""
        python, flag, module, *args = command
        if python != sys.executable or flag != "-m":
            raise ValueError(f"not a python -m command: {command}")
        request = SpawnRequest(module, args, env, os.getcwd())
        read_end, write_end = os.pipe()
        try:
            with self.lock:
                try:
                    socket.send_fds(self.channel, [json.dumps(request.__dict__).encode()], [write_end])
                except OSError as error:
                    raise WarmStartError(f"the warm starter is gone ({error}); {self.where}") from error
                pid = self._await_spawned(time.monotonic() + SPAWN_TIMEOUT_S)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        return WarmProcess(self, pid, command, os.fdopen(read_end, "rb"))

    def _await_spawned(self, deadline: float) -> int:
        while True:
            for message in self._receive(timeout=max(deadline - time.monotonic(), 0)):
                if "spawned" in message:
                    return int(message["spawned"])
            if self.gone or time.monotonic() >= deadline:
                code = self.process.poll()
                raise WarmStartError(
                    f"the warm starter {'exited with ' + str(code) if code is not None else 'did not answer'} "
                    f"before starting a role; {self.where}"
                )

    def _receive(self, timeout: float) -> list[dict]:
        """Messages waiting on the channel (after up to ``timeout`` s for the first); exits are noted."""
        messages = []
        wait = timeout
        while not self.gone and select.select([self.channel], [], [], wait)[0]:
            wait = 0
            try:
                packet = self.channel.recv(MESSAGE_BYTES)
            except OSError:
                packet = b""
            if not packet:
                self.gone = True
                break
            message = json.loads(packet)
            if "exited" in message:
                self.exits[int(message["exited"])] = int(message["code"])
            messages.append(message)
        return messages

    def wait_for_news(self, timeout: float) -> None:
        if self.gone:  # nothing more will come: the caller checks /proc
            time.sleep(min(timeout, 0.05))
            return
        with self.lock:
            self._receive(timeout)

    def exit_code(self, pid: int) -> int | None:
        with self.lock:
            self._receive(timeout=0)
        if pid in self.exits:
            return self.exits[pid]
        if self.gone and not _running(pid):
            # Its warm starter died, and the child with it (PR_SET_PDEATHSIG): reaped by init, its status unknown.
            self.exits[pid] = -signal.SIGKILL
            return self.exits[pid]
        return None

    def close(self) -> None:
        """Let the warm starter go (its children stopped already); it exits when the channel closes."""
        self.channel.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class PoolSession:
    """A pool's session serving this run: not this process's child (the pool reaps it), so what the launcher needs
    of a Popen is read from /proc."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not _running(self.pid):
            self.returncode = 0  # its status is the pool's to reap; a session has no result of its own
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if timeout is not None and deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["warm-start session", str(self.pid)], timeout)
            time.sleep(0.05)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


# The warm starter's side.


def listening(path: str) -> socket.socket:
    """The pool's socket, listening before the imports so that a launcher connecting meanwhile waits for them.
    A socket file left at ``path`` by a pool that died is replaced. Its owner alone may connect (mode 0600, and
    ``sessions`` checks the caller's uid): whoever connects starts any module as the pool's user and hands it a
    role's credentials."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    kept = os.umask(0o177)  # the file is made 0600 by bind itself: no moment in which others may connect
    try:
        server.bind(path)
    finally:
        os.umask(kept)
    server.listen(16)
    return server


def _same_user(channel: socket.socket) -> bool:
    """Whether the process at the other end of ``channel`` runs as this one's user (SO_PEERCRED)."""
    credentials = channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return uid == os.getuid()


def sessions(server: socket.socket) -> socket.socket:
    """Fork a session per launcher that connects, for as long as the pool lives. Returns in a session only, with
    its launcher's channel; the session dies with the pool (and its roles with it)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps finished sessions
    while True:
        channel, _ = server.accept()
        if not _same_user(channel):
            channel.close()
            continue
        _check_fork_safe()
        sys.stdout.flush()
        sys.stderr.flush()
        pool = os.getpid()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            die_with_parent(pool)
            with contextlib.suppress(OSError):  # a launcher gone already: serve sees the channel closed
                channel.send(json.dumps({"session": os.getpid()}).encode())
            return channel
        channel.close()


def serve(channel: socket.socket) -> tuple[SpawnRequest, int] | None:
    """Fork a child per request until the launcher closes the channel; reap them and report their exits.

    Returns in a forked child only, with its request and output pipe; returns None in the warm starter."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes the wake-up fd
    children: set[int] = set()
    while True:
        readable = select.select([channel, wake_read], [], [])[0]
        if wake_read in readable:
            os.read(wake_read, 4096)
            _report_exits(channel, children)
        if channel not in readable:
            continue
        try:
            packet, fds, _, _ = socket.recv_fds(channel, MESSAGE_BYTES, 1)
        except ConnectionResetError:
            packet, fds = b"", []
        if not packet:
            return None  # the launcher is gone or done
        request = SpawnRequest(**json.loads(packet))
        _check_fork_safe()
        sys.stdout.flush()
        sys.stderr.flush()
        starter = os.getpid()
        pid = os.fork()
        if pid == 0:
            die_with_parent(starter)  # at once: a launcher killed now takes this warm starter, and so this role, along
            channel.close()
            signal.set_wakeup_fd(-1)
            os.close(wake_read)
            os.close(wake_write)
            return request, fds[0]
        os.close(fds[0])
        children.add(pid)
        channel.send(json.dumps({"spawned": pid}).encode())


def _report_exits(channel: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            with contextlib.suppress(OSError):  # the launcher may be gone already
                channel.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _check_fork_safe() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in the warm starter: its children cannot use it after a fork")
    if threading.active_count() > 1:
        raise RuntimeError(f"the warm starter runs threads {threading.enumerate()}: a fork would copy their locks")


def become(request: SpawnRequest, output: int) -> None:
    """Turn this forked child into ``python -m MODULE ARGS`` with the request's environment, folder and output.

    ``sys.stdout`` and ``sys.stderr`` stay the objects they are (flushed before the fork): they write to fds 1 and 2,
    now the pipe, buffered as a fresh interpreter's would be with the same environment."""
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the warm starter ignores ctrl-c; a role heeds it
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    sys.argv = [request.module, *request.args]


def main() -> None:
    """``warm_start FD MODULES...`` (a run's own, on the socket pair end FD) or ``warm_start --listen SOCKET
    MODULES...`` (a pool)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl-c is the launcher's to handle, stopping roles in order
    # torch.cuda.is_available() in an imported module would otherwise call cuInit here, which no forked child can
    # undo, while is_initialized() (_check_fork_safe) still says False; NVML answers the same question fork-safely.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    pool = listening(sys.argv[2]) if sys.argv[1] == "--listen" else None
    for module in sys.argv[3:] if pool is not None else sys.argv[2:]:
        importlib.import_module(module)
    channel = sessions(pool) if pool is not None else socket.socket(fileno=int(sys.argv[1]))
    forked = serve(channel)
    if forked is None:
        # A session or a run's own warm starter that is done owns nothing to close or flush; the interpreter's
        # teardown of the imported torch and vLLM would cost it a CPU second (most of its own CPU) for nothing.
        os._exit(0)
    request, output = forked
    become(request, output)
    import runpy

    runpy.run_module(request.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
