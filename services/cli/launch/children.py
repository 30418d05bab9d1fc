"""The launcher's children: one OS process per service, its output pumped to a rotating log (a refusal's reason and
a trainer's lease kept from its JSON events), the restart policy a supervisor would apply, and the command and
environment a trainer starts with."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from rich.console import Console

from services.cli.launch.crash_loop import Crash
from services.common.config import ConfigError, RunConfig, SupervisionConfig
from services.common.observe.events import RECORDED_AS, Event
from services.common.observe.logs import RotatingLog

console = Console(stderr=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RestartPolicy:
    """As a container restart policy would: back off exponentially, give up on a service that dies too often too fast.

    Counted per service over a sliding window, so a service that crashes now and then in a
    week-long run is always restarted, while one in a crash loop fails the run.
    """

    supervision: SupervisionConfig
    # name -> monotonic times of its restarts within the window, oldest first
    recent: dict[str, deque[float]] = field(default_factory=dict)
    # name -> restarts over the whole run, for run.json and the report
    total: dict[str, int] = field(default_factory=dict)

    def next_restart(self, name: str, now: float) -> float | None:
        """Delay before ``name`` is restarted, or None when it has used up its restarts in the window."""
        window = self.recent.setdefault(name, deque())
        while window and now - window[0] >= self.supervision.restart_window_s:
            window.popleft()
        if len(window) >= self.supervision.max_restarts:
            return None
        window.append(now)
        self.total[name] = self.total.get(name, 0) + 1
        return min(self.supervision.backoff_s * 2 ** (len(window) - 1), self.supervision.max_backoff_s)


# The events in which a role gives the reason it refuses to run (exit EXIT_REFUSED), in their ``error`` field.
REFUSAL_EVENTS = (Event.START_REFUSED, Event.STARTUP_CHECK_FAILED, Event.BROKER_STATE_LOST)
# An alert line repeats while its cause lasts (a resume waiting for its store logs every few seconds): the console
# hears it once a minute, the log every time.
ALERT_ECHO_EVERY_S = 60.0
# What to do, for the alerts an operator meets first; any other alert points at the role's log.
ALERT_HINTS: dict[str, str] = {
    Event.RESUME_WAITING: "the trainer waits for its checkpoint store and will not start from base weights: bring "
    "the store back or fix its endpoint and credentials (checkpoint.*), or stop the run",
    Event.FENCED_OUT: "another trainer holds the run: this one writes nothing more; `rlpipe status` names the holder",
    Event.BUS_RESTORE_FAILED: "the broker came back without this run's streams: check nats-server and its store",
    Event.CHECKPOINT_FAILED: "a save failed and training goes on: check the store (space, credentials)",
    Event.ENVIRONMENT_RESET_FAILED: "the episode environment fails to start episodes: check rollout.environment",
}
OUTPUT_TAIL_LINES = 20  # plain (not JSON) output lines kept per child: a refusal printed before logging was set up


class ChildProcess(Protocol):
    """What the launcher uses of a role's process: a ``subprocess.Popen``, or a role the warm starter forked."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Child:
    name: str
    role: str
    process: ChildProcess
    log_path: Path
    log_max_bytes: int
    log_keep: int
    spawned_at: float = field(default_factory=time.time)  # wall time: its presence entry is newer (run_watch.py)
    ready: dict[str, Any] | None = None  # its start-up report and endpoints, once its presence entry has them
    pump_thread: threading.Thread | None = None
    refusal: str | None = None  # the reason of the child's last refusal event
    plain_tail: deque[str] = field(default_factory=lambda: deque(maxlen=OUTPUT_TAIL_LINES))
    dropped_lines: int = 0  # output lines its log could not take (a full disk): drained all the same
    lease_holder: str = ""  # a trainer's, from its lease_acquired event: its restart may take that lease at once
    echo: Callable[[str], None] | None = None  # where its alert lines reach the console that started the run
    echoed: dict[str, float] = field(default_factory=dict)  # event -> monotonic time it was last echoed
    crash: Crash | None = None  # what its crashed event's traceback says, if it died of an exception
    step_at_spawn: int = 0  # the run's last step when it started: a crash after a later one made progress first

    def report(self) -> dict[str, Any]:
        """Its start-up report and endpoints, once it is ready (``Launcher.wait_ready``)."""
        if self.ready is None:
            raise RuntimeError(f"{self.name} is not ready: it has no start-up report yet")
        return self.ready

    def pump(self, stream: IO[bytes]) -> None:
        """Copy the child's output to its (rotating) log file, noting a refusal's reason and a trainer's lease.

        The pipe is drained to its end whatever happens to the log: a child whose output stops being read blocks on
        its next write, so a log that cannot be written (a full disk) costs lines, counted, never the child."""
        log = self._open_log()
        try:
            for line in stream:
                self._note(line)
                if log is None:
                    log = self._open_log()
                try:
                    if log is None:
                        raise OSError(f"cannot open {self.log_path}")
                    log.write(line)
                except OSError as error:
                    self._dropped(error)
        finally:
            if log is not None:
                with contextlib.suppress(OSError):
                    log.close()
            if self.dropped_lines:
                console.log(f"[red]{self.name}: {self.dropped_lines} output line(s) could not be written to its log[/]")

    def _open_log(self) -> RotatingLog | None:
        try:
            return RotatingLog(self.log_path, self.log_max_bytes, self.log_keep)
        except OSError as error:
            self._dropped(error, lines=0)
            return None

    def _dropped(self, error: OSError, lines: int = 1) -> None:
        if not self.dropped_lines:
            console.log(f"[red]{self.name}: cannot write {self.log_path} ({error}); its output is dropped, counted[/]")
        self.dropped_lines += lines

    def _note(self, line: bytes) -> None:
        """Keep a refusal's reason and a trainer's lease from its JSON events, and the tail of the plain output."""
        try:
            event = json.loads(line)
        except ValueError:
            self.plain_tail.append(line.decode(errors="replace").rstrip())
            return
        if not isinstance(event, dict) or "event" not in event:
            return
        if event.get("alert") is True:
            self._echo_alert(event)
        if event["event"] in REFUSAL_EVENTS:
            self.refusal = str(event.get("error", ""))
        elif event["event"] == Event.LEASE_ACQUIRED:
            self.lease_holder = str(event.get("holder", ""))
        elif event["event"] == Event.CRASHED:
            self.crash = Crash.of_traceback(str(event.get("exception", "")))

    def _echo_alert(self, event: dict[str, Any]) -> None:
        """An alert line of this role on the console, once a minute per event, with what to do. Not a refusal
        (the run's end says it once) and not what the trainer records in events.jsonl (the launcher echoes that)."""
        name = str(event["event"])
        recorded = self.role == "trainer" and name in RECORDED_AS
        now = time.monotonic()
        if (
            self.echo is None
            or name in REFUSAL_EVENTS
            or recorded
            or now - self.echoed.get(name, -1e9) < ALERT_ECHO_EVERY_S
        ):
            return
        self.echoed[name] = now
        said = event.get("message") or event.get("error") or event.get("reason")
        hint = ALERT_HINTS.get(name, f"see {self.log_path}")
        head = f"{self.name} {str(event.get('level', 'alert')).lower()}: {name}"
        self.echo(f"{head}: {said}; {hint}" if said else f"{head}; {hint}")

    def refusal_reason(self) -> str:
        """Why the child refused to run: its refusal event's reason, else the end of its plain output."""
        if self.pump_thread is not None:
            self.pump_thread.join(timeout=5)  # its last lines may still be in the pipe
        return self.refusal or "\n".join(line for line in self.plain_tail if line) or "(no reason given)"


class RoleCrashLoop(RuntimeError):
    """A service crashed twice alike with no step between: not restarted again, the run ends with 1."""

    def __init__(self, child: Child, crash: Crash):
        self.name = child.name
        self.crash = crash
        self.log_path = child.log_path
        super().__init__(
            f"{child.name} crashed twice with the same error and no step between, so it is not restarted again: "
            f"{crash.error} (at {crash.where}); its log: {child.log_path}"
        )


class RoleRefused(RuntimeError):
    """A service exited EXIT_REFUSED: it cannot run as configured, so it is not restarted and the run ends with 2."""

    def __init__(self, child: Child):
        self.name = child.name
        self.reason = child.refusal_reason()
        self.log_path = child.log_path
        super().__init__(f"{child.name} refused to run: {self.reason}")


def trainer_command(cfg: RunConfig, command: list[str], cuda_devices: int | None = None) -> list[str]:
    """``command`` (``python -m services.trainer ...``) under torchrun when ``trainer.nproc`` > 1: one process per
    device on this machine (``--standalone``: a rendezvous on localhost, on a free port).

    Raises ConfigError naming trainer.nproc when the model runs on CUDA and this machine has fewer GPUs
    (``cuda_devices``: torch's count by default). On the CPU any count runs, as processes on gloo."""
    nproc = cfg.trainer.nproc
    if nproc == 1:
        return command
    import torch  # only a launch that shards needs it

    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    on_cuda = cfg.model.device == "cuda" or (cfg.model.device == "auto" and count > 0)
    if on_cuda and nproc > count:
        raise ConfigError(
            f"invalid configuration:\n  trainer.nproc: {nproc} trainer processes, one per GPU, but this machine has "
            f"{count} CUDA device(s): set trainer.nproc to at most {count}, or model.device: cpu"
        )
    # torchrun through services.trainer.learning.distributed, which keeps a rank's EXIT_REFUSED (torchrun's own exit
    # is 1).
    launch = [sys.executable, "-m", "services.trainer.learning.distributed"]
    return [*launch, "--standalone", f"--nproc-per-node={nproc}", *command[1:]]


def trainer_env(cfg: RunConfig) -> dict[str, str]:
    """torchrun passes SIGTERM on to its processes and kills them after TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by
    default): as long as the trainer may take for its final save."""
    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(cfg.supervision.trainer_stop_grace_s))}


def restart_env(exited: Child) -> dict[str, str]:
    """What a child the launcher saw exit is restarted with: resume, and for a trainer, the lease it held.

    The launcher has waited on that process, so it knows it is dead: the restart takes its lease at once instead
    of waiting up to ``trainer.lease_ttl_s`` for it to run out (see services/trainer/lease.py)."""
    env = {"RLPIPE_CHECKPOINT__RESUME": "true"}
    if exited.role == "trainer" and exited.lease_holder:
        env["RLPIPE_TRAINER__TAKEOVER_FROM"] = exited.lease_holder
    return env
