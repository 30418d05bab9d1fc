"""``rlpipe run CONFIG``: the whole pipeline on one machine.

Starts a local NATS server with JetStream in the run directory, then one OS process
per service, all at once (the others wait for the streams the trainer creates; a
rollout reads the trainer's port from its presence entry), each waited on until it logs
``ready``; runs/<run>/startup.jsonl records when each was ready, and the first step, in
seconds after the launch. Shows a progress bar over training steps, and at
the end writes the report plot and a summary, stops every process and exits
non-zero if any service failed.

A run directory that already holds checkpoints or metrics is never deleted by accident:
``--resume`` continues it, ``--overwrite`` deletes it and starts over, and without either
the launcher refuses (exit 2). A service that dies is restarted with exponential backoff,
unless it died more than ``supervision.max_restarts`` times within
``supervision.restart_window_s``, or refused to run (exit 2, ``services/common/refusal.py``): then the
run stops, prints the service's reason and exits 2. On stop each service gets its own grace after SIGTERM
(``supervision.trainer_stop_grace_s`` for the trainer's final save,
``supervision.stop_grace_s`` for the others) before SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import os
import queue
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import nats
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from services.cli.report import read_jsonl, render_html, render_report, time_lines
from services.cli.run_archive import archive_and_describe
from services.cli.runs import record_exit
from services.common.config import (
    AdminCredentials,
    ConfigError,
    NatsConfig,
    RunConfig,
    SupervisionConfig,
    WeightSyncCredentials,
    load_config_with,
    parse_overrides,
)
from services.common.observe.events import Event, EventLog
from services.common.observe.logs import RotatingLog
from services.common.observe.usage import USAGE_FILE, RunCost, UsageMeter, with_descendants
from services.common.service import EXIT_REFUSED
from services.common.startup_checks import StartupCheckError, startup_checks
from services.common.transport.live_config import LiveConfig
from services.common.transport.nats_auth import RoleKey, server_authorization, write_run_credentials
from services.common.transport.nats_connect import connect_options
from services.common.transport.nats_server import embedded_config, nats_server_binary
from services.common.transport.storage import write_atomically

console = Console(stderr=True)
READY_TIMEOUT_S = 600.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # an operator's or a supervisor's stop: orderly, not a failure
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # Linux: a child is killed when the launcher dies, even by SIGKILL, so nothing is orphaned.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


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
# Credentials the launcher hands to the roles that need them (role_env), never to every child through its own shell.
ROLE_TOKENS = ("RLPIPE_ADMIN_TOKEN", "RLPIPE_WEIGHTSYNC_TOKEN")
OUTPUT_TAIL_LINES = 20  # plain (not JSON) output lines kept per child: a refusal printed before logging was set up


@dataclass
class Child:
    name: str
    role: str
    process: subprocess.Popen
    log_path: Path
    log_max_bytes: int
    log_keep: int
    events: queue.Queue = field(default_factory=queue.Queue)
    ready: dict[str, Any] | None = None
    pump_thread: threading.Thread | None = None
    refusal: str | None = None  # the reason of the child's last refusal event
    plain_tail: deque[str] = field(default_factory=lambda: deque(maxlen=OUTPUT_TAIL_LINES))
    dropped_lines: int = 0  # output lines its log could not take (a full disk): drained all the same
    lease_holder: str = ""  # a trainer's, from its lease_acquired event: its restart may take that lease at once

    def pump(self, stream: IO[bytes]) -> None:
        """Copy the child's output to its (rotating) log file and pass its JSON events on.

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
        """Pass a JSON event on (and keep a refusal's reason); keep the tail of the plain output."""
        try:
            event = json.loads(line)
        except ValueError:
            self.plain_tail.append(line.decode(errors="replace").rstrip())
            return
        if not isinstance(event, dict) or "event" not in event:
            return
        if event["event"] in REFUSAL_EVENTS:
            self.refusal = str(event.get("error", ""))
        elif event["event"] == Event.LEASE_ACQUIRED:
            self.lease_holder = str(event.get("holder", ""))
        self.events.put(event)

    def refusal_reason(self) -> str:
        """Why the child refused to run: its refusal event's reason, else the end of its plain output."""
        if self.pump_thread is not None:
            self.pump_thread.join(timeout=5)  # its last lines may still be in the pipe
        return self.refusal or "\n".join(line for line in self.plain_tail if line) or "(no reason given)"


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
    # torchrun through services.trainer.distributed, which keeps a rank's EXIT_REFUSED (torchrun's own exit is 1).
    launch = [sys.executable, "-m", "services.trainer.distributed"]
    return [*launch, "--standalone", f"--nproc-per-node={nproc}", *command[1:]]


def trainer_env(cfg: RunConfig) -> dict[str, str]:
    """torchrun passes SIGTERM on to its processes and kills them after TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by
    default): as long as the trainer may take for its final save."""
    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(cfg.supervision.trainer_stop_grace_s))}


class Launcher:
    def __init__(self, cfg: RunConfig, config_path: Path, resume: bool):
        self.cfg = cfg
        self.config_path = config_path
        self.resume = resume
        self.run_dir = cfg.run_dir
        self.children: list[Child] = []
        self.nats: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        # component (nats, each service, "first step") -> seconds after the launch it was ready; startup.jsonl
        self.startup: dict[str, float] = {}
        self.launched = time.perf_counter()
        self.restart_policy = RestartPolicy(cfg.supervision)
        # name -> restarts over the whole run (nats-server's too); run.json shows it
        self.restarts: dict[str, int] = self.restart_policy.total
        self.nats_port = 0
        self.nats_keys: dict[str, RoleKey] = {}
        self.weight_sync_token = ""
        self.events = EventLog.of_run(cfg)
        self.usage = UsageMeter()
        self._usage_sampled = 0.0

    def start_nats(self, port: int | None = None) -> str:
        """nats-server with JetStream on ``port`` (a free one by default), its store in the run directory."""
        port = port or free_port()
        self.nats_port = port
        store = self.run_dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        logs = self.run_dir / "logs"
        # The server's own log rotates (service.log_max_mib, service.log_keep); what it prints before that log
        # opens (a config error) or when it crashes goes to nats.out, which a healthy server never writes to.
        out = (logs / "nats.out").open("ab")
        conf = self.run_dir / "nats.conf"
        authorization = server_authorization(self.cfg.run_id, list(self.nats_keys.values()))
        log = ((logs / "nats.log").resolve(), self.cfg.service)
        conf.write_text(embedded_config(port, store, self.cfg.nats.sync_always, authorization, log))
        self.nats = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        out.close()  # the child holds its own copy
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.nats.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.nats.returncode}; see {logs}/nats.out and nats.log")
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return f"nats://127.0.0.1:{port}"
            time.sleep(0.05)
        raise RuntimeError("nats-server did not accept connections within 30 s")

    def forget_pause(self, nats_url: str) -> None:
        """``--resume`` continues on purpose: a pause or stop recorded before must not hold the new start."""

        async def clear() -> dict[str, Any]:
            nc = await nats.connect(nats_url, **connect_options(self.nats_cfg("trainer"), "trainer"))
            try:
                live = await LiveConfig(self.cfg, nc.jetstream()).start()
                earlier = await live.get_control()
                await live.clear_control()
                return earlier
            finally:
                await nc.close()

        earlier = asyncio.run(clear())
        if earlier.get("paused"):
            console.log(f"continuing a run that was held ({earlier.get('reason', '')})")

    def nats_cfg(self, role: str) -> NatsConfig:
        """The broker settings of ``role``: this run's broker with that role's key."""
        return self.cfg.nats.model_copy(update={"nkey_seed_file": self.nats_keys[role].seed_file})

    def role_env(self, role: str) -> dict[str, str]:
        """What only ``role`` is given: its own NATS key, the admin token for the trainer alone (as a file it
        re-reads, so that rewriting runs/<run>/admin.token rotates it), and the weight-sync token for the trainer and
        the rollouts, the two ends of WeightSync."""
        env = {"RLPIPE_NATS__NKEY_SEED_FILE": str(self.nats_keys[role].seed_file)}
        if role == "trainer":
            env["RLPIPE_ADMIN__TOKEN_FILE"] = str(self.token_file)
        if role in ("trainer", "rollout"):
            env["RLPIPE_WEIGHTSYNC_TOKEN"] = self.weight_sync_token
        return env

    @property
    def token_file(self) -> Path:
        return self.run_dir.resolve() / "admin.token"

    def write_admin_token(self) -> None:
        """RLPIPE_ADMIN_TOKEN if set, else a fresh one; kept owner-only in the run directory for the CLI."""
        token = AdminCredentials().token or secrets.token_urlsafe(24)
        self.token_file.touch(mode=0o600)
        # touch's mode applies only to a new file: one kept from an earlier start (--resume) may be readable by all.
        self.token_file.chmod(0o600)
        self.token_file.write_text(token + "\n")

    def spawn(self, role: str, name: str, env: dict[str, str] | None = None) -> Child:
        log_path = self.run_dir / "logs" / f"{name}.log"
        command = [sys.executable, "-m", f"services.{role}", "--config", str(self.config_path)]
        if role == "trainer" and self.cfg.trainer.nproc > 1:
            command, env = trainer_command(self.cfg, command), {**trainer_env(self.cfg), **(env or {})}
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**self.env, "RLPIPE_SERVICE__INSTANCE": name, **self.role_env(role), **(env or {})},
            preexec_fn=_die_with_parent,
        )
        child = Child(name, role, process, log_path, self.cfg.service.log_max_mib * 2**20, self.cfg.service.log_keep)
        child.pump_thread = threading.Thread(target=child.pump, args=(process.stdout,), daemon=True)
        child.pump_thread.start()
        self.children = [c for c in self.children if c.name != name] + [child]
        return child

    def sample_usage(self, every_s: float = 2.0) -> None:
        """CPU and GPU time of every running service and its subprocesses, at most every ``every_s`` seconds."""
        now = time.monotonic()
        if now - self._usage_sampled < every_s:
            return
        self._usage_sampled = now
        pids = {
            pid: child.role
            for child in self.children
            if child.process.poll() is None
            for pid in with_descendants(child.process.pid)
        }
        self.usage.sample(pids, now)

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def write_run_file(self) -> None:
        """runs/<run>/run.json: where things are, for tests and tools (and, later, the admin CLI)."""
        info = {
            "run_id": self.cfg.run_id,
            "nats_url": self.env["RLPIPE_NATS__URL"],
            "trainer": self.child("trainer").ready["grpc"] if self.child("trainer").ready else None,
            "admin": self.child("trainer").ready["admin"] if self.child("trainer").ready else None,
            "pids": {"nats": self.nats.pid, **{c.name: c.process.pid for c in self.children}},
            "restarts": self.restarts,
            "services": {
                c.name: {
                    "role": c.role,
                    "pid": c.process.pid,
                    **{k: c.ready[k] for k in ("grpc", "admin", "metrics_url") if c.ready and k in c.ready},
                }
                for c in self.children
            },
        }
        # Atomically: the CLI and tests read it while the run goes on.
        write_atomically(self.run_dir / "run.json", json.dumps(info, indent=2).encode())

    def record_startup(self, name: str, event: dict[str, Any]) -> None:
        """One JSON line per component in runs/<run>/startup.jsonl: what it loaded, and when it was ready, in
        seconds after the launch (the phases of a start-up: every service, then the first step)."""
        self.startup[name] = round(time.perf_counter() - self.launched, 3)
        row = {
            "component": name,
            "ready_after_s": self.startup[name],
            **{k: v for k, v in event.items() if k not in ("level", "event")},
        }
        with (self.run_dir / "startup.jsonl").open("a") as out:
            out.write(json.dumps(row) + "\n")

    def wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = list(children)
        while waiting:
            for child in list(waiting):
                while not child.events.empty():
                    event = child.events.get()
                    if event["event"] == Event.READY:
                        child.ready = event
                        self.record_startup(child.name, event)
                        console.log(
                            f"[green]{child.name} ready[/] {self.startup[child.name]:.1f}s after the launch "
                            + _startup_fields(event)
                        )
                        waiting.remove(child)
                        break
                    if event["event"] in (Event.RESUMED, Event.PAUSED):  # a trainer restores its run before it is ready
                        console.log(f"{child.name} {event['event']}: " + _event_summary(event))
                if child.ready is None and child.process.poll() == EXIT_REFUSED:
                    raise RoleRefused(child)
                if child.ready is None and child.process.poll() is not None:
                    raise RuntimeError(
                        f"{child.name} exited with {child.process.returncode} before it was ready; see {child.log_path}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {READY_TIMEOUT_S:.0f}s: {[c.name for c in waiting]}")
            time.sleep(0.05)

    def start(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        # Fresh keys at every start: a key of an earlier run of this directory opens nothing.
        self.nats_keys = write_run_credentials(self.run_dir.resolve() / "nats-auth")
        nats_url = self.start_nats()
        self.record_startup("nats", {"url": nats_url, "store": str(self.run_dir / "nats")})
        console.log(f"[green]nats ready[/] at {nats_url} {self.startup['nats']:.1f}s after the launch")
        if self.resume:
            self.forget_pause(nats_url)
        self.write_admin_token()
        # RLPIPE_WEIGHTSYNC_TOKEN if set, else one for this start: the trainer and the rollouts start together.
        self.weight_sync_token = WeightSyncCredentials().token or secrets.token_urlsafe(24)
        # Only the roles that need a token are given it (role_env); no service inherits one from this shell.
        inherited = {name: value for name, value in os.environ.items() if name not in ROLE_TOKENS}
        self.env = {**inherited, "RLPIPE_NATS__URL": nats_url}
        # Every role at once: the trainer creates the run's streams and buckets, which the others wait for (any
        # start order works, docs/architecture.md), so their model and engine loads overlap the trainer's. The
        # trainer binds ports the OS picks (two local runs must not collide on the defaults), or the admin port
        # the config names; restarted services then use the ports it got.
        admin_port = self.cfg.admin.port if "port" in self.cfg.admin.model_fields_set else 0
        ports = {"RLPIPE_SERVICE__TRAINER_GRPC_PORT": "0", "RLPIPE_ADMIN__PORT": str(admin_port)}
        # A fresh run must not pick up an older run's checkpoints under the same run id; restarts resume.
        trainer = self.spawn("trainer", "trainer", env={**ports, "RLPIPE_CHECKPOINT__RESUME": str(self.resume).lower()})
        others = [self.spawn("reference", f"reference-{i}") for i in range(self.cfg.reference.replicas)]
        others += [self.spawn("reward", f"reward-{i}") for i in range(self.cfg.reward.replicas)]
        # Port 0: a rollout reads the trainer's port from its presence entry once it has loaded its engine.
        others += [
            self.spawn("rollout", f"rollout-{i}", env={"RLPIPE_SERVICE__TRAINER_GRPC_PORT": "0"})
            for i in range(self.cfg.rollout.replicas)
        ]
        self.wait_ready([trainer])
        # A restarted rollout or trainer is given the port the trainer got.
        self.env["RLPIPE_SERVICE__TRAINER_GRPC_PORT"] = trainer.ready["grpc"].rpartition(":")[2]
        self.env["RLPIPE_ADMIN__PORT"] = trainer.ready["admin"].rpartition(":")[2]
        self.wait_ready(others)
        self.write_run_file()
        console.log(
            "operate it from another shell: rlpipe status | pause | resume | config set KEY=VALUE | rollback STEP | "
            f"stop (admin at {self.child('trainer').ready['admin']})"
        )

    def follow(self) -> dict[str, Any]:
        """Progress over training steps until the trainer is done, restarting services that die."""
        done: dict[str, Any] = {}
        due: dict[str, float] = {}  # name -> when to restart it
        columns = (
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("steps", total=self.cfg.train.total_steps, info="")
            while not done:
                trainer = self.child("trainer")
                if trainer.process.poll() is not None and trainer.pump_thread:
                    trainer.pump_thread.join(timeout=5)  # its last lines may still be in the pipe
                for child in self.children:
                    if child is not trainer:
                        self.note_ready(child)
                while not trainer.events.empty():
                    event = trainer.events.get()
                    if event["event"] == Event.READY:
                        trainer.ready = event
                        self.write_run_file()
                    elif event["event"] == Event.STEP:
                        if "first step" not in self.startup:
                            self.record_startup("first step", {"step": event["step"]})
                        info = (
                            f"reward {event['reward_mean']:.3f}  entropy {event['entropy']:.3f}  "
                            f"kl {event['kl_ref']:.4f}"
                        )
                        progress.update(task, completed=event["step"], info=info)
                    elif event["event"] == Event.EVAL:
                        progress.console.log(f"eval at step {event['step']}: accuracy {event['eval_accuracy']:.3f}")
                    elif event["event"] == Event.RESUMED:
                        progress.console.log(
                            f"trainer resumed from step {event['step']} as policy version {event['policy_version']}"
                        )
                    elif event["event"] in (
                        Event.PAUSED,
                        Event.UNPAUSED,
                        Event.ROLLED_BACK,
                        Event.CONFIG_APPLIED,
                        Event.ALERT,
                    ):
                        progress.console.log(f"trainer {event['event']}: " + _event_summary(event))
                    elif event["event"] == Event.DONE:
                        done = event
                if done:
                    break
                if self.nats.poll() is not None:
                    # Same port and store: streams, consumers and unacked messages come back; clients reconnect.
                    self.restarts["nats"] = self.restarts.get("nats", 0) + 1
                    self.events.write(
                        Event.RESTART,
                        f"nats-server exited with {self.nats.returncode}; restarting it",
                        service="nats",
                        restarts=self.restarts["nats"],
                    )
                    progress.console.log(f"[yellow]nats-server exited with {self.nats.returncode}[/]; restarting it")
                    self.start_nats(self.nats_port)
                    self.write_run_file()
                self.sample_usage()
                for child in self.children:
                    if child.process.poll() is not None and child.name not in due:
                        due[child.name] = self.schedule_restart(child, progress)
                for name, when in list(due.items()):
                    if time.monotonic() >= when:
                        del due[name]
                        restarted = self.child(name)
                        self.spawn(restarted.role, name, env=restart_env(restarted))
                        self.write_run_file()
                time.sleep(0.1)
        self.child("trainer").process.wait(timeout=60)
        return done

    def note_ready(self, child: Child) -> None:
        """Drain a worker's events; a restarted one's ``ready`` puts its new endpoints in run.json."""
        while not child.events.empty():
            event = child.events.get()
            if event["event"] == Event.READY:
                child.ready = event
                self.write_run_file()

    def schedule_restart(self, child: Child, progress: Progress) -> float:
        """When to restart ``child``, which exited; raises RuntimeError when it died too often too fast, or
        refused to run (exit EXIT_REFUSED): restarting it would fail alike, or resume a run it refused."""
        supervision = self.cfg.supervision
        if child.process.returncode == EXIT_REFUSED:
            raise RoleRefused(child)
        delay = self.restart_policy.next_restart(child.name, time.monotonic())
        if delay is None:
            raise RuntimeError(
                f"{child.name} exited with {child.process.returncode} after {supervision.max_restarts} restarts within "
                f"supervision.restart_window_s={supervision.restart_window_s:g}s; see {child.log_path}"
            )
        count = self.restarts[child.name]
        progress.console.log(
            f"[yellow]{child.name} exited with {child.process.returncode}[/]; restart {count} in {delay:.1f}s"
        )
        self.events.write(
            Event.RESTART,
            f"{child.name} exited with {child.process.returncode}; restart {count} in {delay:.1f}s",
            service=child.name,
            restarts=count,
        )
        return time.monotonic() + delay

    def stop_grace_s(self, child: Child) -> float:
        """How long ``child`` may take to exit after SIGTERM: the trainer saves a final checkpoint first. A stage
        not ready yet gets none: it holds no work, and while it waits for the trainer's streams it does not heed
        SIGTERM (docs/architecture.md), so a start cut short (a trainer that refused) would wait out its grace."""
        supervision = self.cfg.supervision
        if child.role != "trainer" and child.ready is None:
            return 0.0
        return supervision.trainer_stop_grace_s if child.role == "trainer" else supervision.stop_grace_s

    def stop(self) -> list[str]:
        """Stop every process (SIGTERM, then SIGKILL after its own grace); returns the services that failed."""
        self.sample_usage(every_s=0)  # the last reading of each process before it goes
        running = [child for child in self.children if child.process.poll() is None]
        for child in running:
            child.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        # Shortest grace first: each wait ends at its own deadline, all counted from the same SIGTERM.
        for child in sorted(running, key=self.stop_grace_s):
            grace = self.stop_grace_s(child)
            if child.role == "trainer" and child.process.poll() is None:
                console.log(f"waiting up to {grace:g}s for the trainer's final save (Ctrl-C again kills it)")
            try:
                child.process.wait(timeout=max(started + grace - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                console.log(f"[red]{child.name} did not exit within {grace:g}s of SIGTERM[/]; killing it")
                child.process.kill()
                child.process.wait()
        for child in self.children:
            if child.pump_thread:
                child.pump_thread.join(timeout=5)  # the last lines a service wrote before exiting reach its log
        if self.nats and self.nats.poll() is None:
            self.nats.terminate()
            self.nats.wait(timeout=20)
        # A clean stop is exit 0 (or death by our SIGTERM); a crash or a hang that needed SIGKILL is a failure.
        return [c.name for c in self.children if c.process.returncode not in (0, -signal.SIGTERM)]

    def kill(self) -> list[str]:
        """SIGKILL every process at once (a stop cut short); returns the services it killed."""
        killed = [child.name for child in self.children if child.process.poll() is None]
        for process in [child.process for child in self.children] + ([self.nats] if self.nats else []):
            if process.poll() is None:
                process.kill()
                process.wait()
        return killed


def restart_env(exited: Child) -> dict[str, str]:
    """What a child the launcher saw exit is restarted with: resume, and for a trainer, the lease it held.

    The launcher has waited on that process, so it knows it is dead: the restart takes its lease at once instead
    of waiting up to ``trainer.lease_ttl_s`` for it to run out (see services/trainer/lease.py)."""
    env = {"RLPIPE_CHECKPOINT__RESUME": "true"}
    if exited.role == "trainer" and exited.lease_holder:
        env["RLPIPE_TRAINER__TAKEOVER_FROM"] = exited.lease_holder
    return env


def _event_summary(event: dict[str, Any]) -> str:
    keys = ("step", "reason", "policy_version", "config_version", "changed", "rule", "message")
    # A journal line carries its message beside the reason it was made of: one of them is enough.
    said = [k for k in keys if k in event and not (k == "message" and event[k] == event.get("reason"))]
    return " ".join(f"{k}={event[k]}" for k in said)


def _startup_fields(event: dict[str, Any]) -> str:
    keys = ("backend", "engine_load_s", "model_load_s", "grpc", "admin")
    # A journal line carries its message beside the reason it was made of: one of them is enough.
    said = [k for k in keys if k in event and not (k == "message" and event[k] == event.get("reason"))]
    return " ".join(f"{k}={event[k]}" for k in said)


def run_cost(cfg: RunConfig, done: dict[str, Any], usage: UsageMeter) -> RunCost:
    """The run's device-hours and cost, also written to runs/<run>/usage.json for the report."""
    baseline, final = done.get("baseline_accuracy"), done.get("final_accuracy")
    cost = RunCost(
        device_hours=usage.device_hours(),
        prices=dict(cfg.cost.per_device_hour),
        steps=int(done.get("steps") or 0),
        accuracy_gain=None if baseline is None or final is None else final - baseline,
    )
    write_atomically(cfg.run_dir / USAGE_FILE, json.dumps(cost.as_record(), indent=2).encode())
    return cost


def summarize(
    cfg: RunConfig, done: dict[str, Any], startup: dict[str, float], wall_s: float, cost: RunCost | None = None
) -> Table:
    rows = read_jsonl(cfg.metrics_file)
    steps = [r for r in rows if "reward_mean" in r]
    table = Table(title=f"run {cfg.run_id}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    baseline, final = done.get("baseline_accuracy"), done.get("final_accuracy")
    if baseline is not None and final is not None:
        table.add_row("eval accuracy (start -> end)", f"{baseline:.3f} -> {final:.3f}  ({final - baseline:+.3f})")
    table.add_row("steps", str(done.get("steps")))
    if steps:
        first, last = steps[: max(len(steps) // 10, 1)], steps[-max(len(steps) // 10, 1) :]
        for key in ("reward_mean", "entropy", "kl_ref", "response_length_mean", "termination_rate"):
            table.add_row(f"{key} (first -> last 10%)", f"{_mean(first, key):.4f} -> {_mean(last, key):.4f}")
        filtered = [r["dynamic_sampling/dropped_fraction"] for r in steps if "dynamic_sampling/dropped_fraction" in r]
        if filtered:
            table.add_row("groups filtered by dynamic sampling (mean share)", f"{sum(filtered) / len(filtered):.3f}")
        completions = sum(r["completions"] for r in steps)
        table.add_row("completions/s (training wall time)", f"{completions / max(wall_s, 1e-9):.1f}")
    table.add_row("wall time", f"{wall_s:.1f}s")
    table.add_row("ready (s after launch)", ", ".join(f"{k} {v:.1f}" for k, v in startup.items()))
    for quantity, value in time_lines(rows):
        table.add_row(quantity, value)
    for quantity, value in cost.lines() if cost else ():
        table.add_row(quantity, value)
    return table


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def previous_run(cfg: RunConfig) -> list[str]:
    """What of an earlier run under this run id a fresh start would destroy: local checkpoints, metrics."""
    found = []
    steps = sorted(path.name for path in cfg.run_dir.glob("step-*") if path.is_dir())
    if steps:
        found.append(f"{len(steps)} checkpoint{'s' if len(steps) > 1 else ''} ({steps[0]} to {steps[-1]})")
    if cfg.metrics_file.is_file() and cfg.metrics_file.stat().st_size > 0:
        found.append(f"metrics in {cfg.metrics_file}")
    return found


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the operator (or a supervisor) ends the run; it stops in order, it did not fail."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


def interrupt(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def stop_or_kill(launcher: Launcher) -> list[str]:
    """Every service stopped in order (``Launcher.stop``); a second Ctrl-C or SIGTERM meanwhile kills them now."""
    try:
        return launcher.stop()
    except Interrupted as again:
        console.log(f"[red]{again.name} again: killing every service now[/]")
        return launcher.kill()


def _write_reports(cfg: RunConfig) -> Path:
    """The run's PNG report (returned) and its HTML page, from whatever metrics it has."""
    report = render_report(cfg.metrics_file, cfg.run_dir / "report.png", cfg.run_dir / "events.jsonl")
    render_html(cfg.run_dir)
    return report


def _plain(message: str) -> None:
    """Unstyled and unwrapped, so a script or a person can grep it."""
    console.print(message, markup=False, highlight=False, soft_wrap=True)


class RunIsLive(RuntimeError):
    """Another ``rlpipe run`` of this run id is running on this machine."""


def launcher_lock(cfg: RunConfig) -> Path:
    """``runs/<run>.launcher.lock``, beside the run directory: ``--overwrite`` deletes the directory, not the lock."""
    return cfg.run_dir.with_name(f"{cfg.run_dir.name}.launcher.lock")


def hold_run(cfg: RunConfig) -> IO[str]:
    """Hold this run for this launcher's life (an exclusive ``flock``, which the kernel drops when the process ends,
    SIGKILL included), or raise RunIsLive naming the launcher that holds it and where its run is served.

    The open file is the hold: closing it lets another launcher in. On one machine only; a trainer on another
    machine is kept out by the trainer's lease (services/trainer/lease.py)."""
    path = launcher_lock(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        served = ""
        with contextlib.suppress(OSError, ValueError):
            info = json.loads((cfg.run_dir / "run.json").read_text())
            served = f", its broker at {info['nats_url']}"
        raise RunIsLive(f"run {cfg.run_id} in {cfg.run_dir} is live: launcher pid {holder} runs it{served}") from None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def run(config_path: Path, resume: bool = False, overwrite: bool = False, overrides: Sequence[str] = ()) -> int:
    """Run the pipeline in ``runs/<run>``; 2 without starting anything when the config or the machine is not fit.

    ``resume`` continues the run there (its streams and checkpoints); ``overwrite`` deletes it
    first. With neither, a directory holding an earlier run's checkpoints or metrics is refused,
    so re-running a config by accident cannot destroy a run. ``overrides`` are command-line
    ``KEY=VALUE`` settings over the file; the services then read ``runs/<run>/run-config.yaml``.
    """
    if resume and overwrite:
        _plain("rlpipe run: --resume continues the run in its directory and --overwrite deletes it: choose one")
        return 2
    cfg, config_data = load_config_with(config_path, parse_overrides(overrides))
    try:
        hold = hold_run(cfg)  # before anything is touched: --resume and --overwrite of a live run would wreck it
    except RunIsLive as error:
        _plain(f"rlpipe run: {error}; nothing was changed. Stop it first (rlpipe stop, or Ctrl-C in its shell)")
        return 2
    with hold:
        return _run_held(cfg, config_data, config_path, resume, overwrite, overrides)


def _run_held(
    cfg: RunConfig,
    config_data: dict[str, Any],
    config_path: Path,
    resume: bool,
    overwrite: bool,
    overrides: Sequence[str],
) -> int:
    """``run`` once this launcher holds the run."""
    earlier = previous_run(cfg)
    if earlier and not (resume or overwrite):
        command = shlex.join(["rlpipe", "run", str(config_path), *overrides])
        _plain(
            f"rlpipe run: {cfg.run_dir} already holds a run ({', '.join(earlier)}); nothing was changed.\n"
            f"  continue it:               {command} --resume\n"
            f"  delete it and start over:  {command} --overwrite"
        )
        return 2
    try:
        startup_checks(cfg, "run")
    except StartupCheckError as error:
        console.log(f"[red]rlpipe run: {error}[/] (rlpipe doctor --embedded --config {config_path} shows every check)")
        return 2
    if not resume:
        if cfg.run_dir.exists():
            console.log(f"starting afresh: removing the previous {cfg.run_dir}")
            shutil.rmtree(cfg.run_dir)
        # A metrics_path outside the run directory would otherwise carry the old run's rows into the new one's.
        cfg.metrics_file.unlink(missing_ok=True)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    # Until this run's services are ready, run.json must not point the CLI at the ports of the previous one.
    (cfg.run_dir / "run.json").unlink(missing_ok=True)
    if overrides:  # the services read a file: the one they get has the overrides written in
        config_path = cfg.run_dir / "run-config.yaml"
        config_path.write_text(yaml.safe_dump(config_data, sort_keys=False))
    launcher = Launcher(cfg, config_path, resume)
    # Ctrl-C and SIGTERM (a supervisor, `timeout`) get the same orderly shutdown.
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, interrupt)
    try:
        code = _supervise(cfg, config_path, launcher)
        record_exit(cfg.run_dir, code)  # how it ended, for `rlpipe runs`
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _supervise(cfg: RunConfig, config_path: Path, launcher: Launcher) -> int:
    """Start the services, follow the run to its end, stop them; the run's exit code."""
    try:
        launcher.start()
        training_started = time.perf_counter()
        done = launcher.follow()
        wall_s = time.perf_counter() - training_started
    except Interrupted as interrupted:
        console.log(f"{interrupted.name}: stopping every service; the trainer saves the step in hand")
        failed = stop_or_kill(launcher)
        run_cost(cfg, {}, launcher.usage)
        _write_reports(cfg)
        console.log(archive_and_describe(cfg))
        if failed:
            console.log(f"[red]services failed:[/] {failed}")
        _plain(f"rlpipe run: stopped; continue it with {shlex.join(['rlpipe', 'run', str(config_path), '--resume'])}")
        return 128 + interrupted.signum
    except RoleRefused as refused:
        stop_or_kill(launcher)
        _plain(f"rlpipe run: {refused.name} refused to run: {refused.reason}\n  its log: {refused.log_path}")
        return EXIT_REFUSED
    except RuntimeError as error:
        console.log(f"[red]run failed:[/] {error}")
        stop_or_kill(launcher)
        return 1
    failed = stop_or_kill(launcher)

    cost = run_cost(cfg, done, launcher.usage)
    report = _write_reports(cfg)
    console.log(archive_and_describe(cfg))
    console.print(summarize(cfg, done, launcher.startup, wall_s, cost))
    console.log(f"metrics: {cfg.metrics_file}  report: {report}  logs: {cfg.run_dir / 'logs'}")
    if failed:
        console.log(f"[red]services failed:[/] {failed}")
        return 1
    return 0
