"""The Launcher behind ``rlpipe run`` (services/cli/launch/command.py): the whole pipeline on one machine.

Issues the start's credentials (services/cli/launch/credentials.py), starts a local NATS server with JetStream in
the run directory (services/cli/launch/broker.py), then one OS process per service
(services/cli/launch/children.py), all at once (the others wait for the streams the trainer creates; a rollout
reads the trainer's port from its presence entry), each waited on until its presence entry says it is ready
(services/cli/launch/watch.py); runs/<run>/startup.jsonl (services/cli/launch/files.py) records when each was
ready, and the first step, in seconds after the launch; the roles are forked warm where they can be
(services/cli/launch/warm_forks.py). Shows a progress bar over training steps, read from the metrics file, until
``events.jsonl`` records the trainer's ``done``. Replicas of a stage role are added or removed while it runs, as
``rlpipe scale`` asks (services/cli/launch/scaling.py).

A service that dies is restarted with exponential backoff,
unless it died more than ``supervision.max_restarts`` times within
``supervision.restart_window_s``, or refused to run (exit 2, ``services/common/refusal.py``): then the
run stops, prints the service's reason and exits 2. On stop each service gets its own grace after SIGTERM
(``supervision.trainer_stop_grace_s`` for the trainer's final save,
``supervision.stop_grace_s`` for the others) before SIGKILL.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from services.cli.launch.broker import RunBroker
from services.cli.launch.children import (
    Child,
    RestartPolicy,
    RoleCrashLoop,
    RoleRefused,
    restart_env,
    trainer_command,
    trainer_env,
)
from services.cli.launch.crash_loop import CrashLoopGuard
from services.cli.launch.credentials import RunCredentials, inherited_env
from services.cli.launch.files import StartupRecord, write_run_file
from services.cli.launch.narration import (
    LAUNCHER_SAYS,
    console,
    echo_alert,
    event_summary,
    held_on_resume,
    startup_fields,
)
from services.cli.launch.placement import RunPlacement, place_roles
from services.cli.launch.scaling import LAUNCHER_SCALES, ReplicaScaler, forget_presence, forget_scale_requests
from services.cli.launch.stopping import kill_children, stop_children
from services.cli.launch.warm_forks import WarmForks
from services.cli.launch.watch import PresenceWatch, RunRecord
from services.common.config import RunConfig
from services.common.observe import metrics as m
from services.common.observe.events import Event, EventLog
from services.common.observe.records import RunDone
from services.common.observe.usage import UsageMeter, with_descendants
from services.common.parent_death import dies_with_this_process
from services.common.service import EXIT_REFUSED

READY_TIMEOUT_S = 600.0


class Launcher:
    """One run's broker and service processes: started, followed (restarted as the policy allows), stopped."""

    def __init__(
        self, cfg: RunConfig, config_path: Path, resume: bool, hold: str = "", placement: RunPlacement | None = None
    ):
        self.cfg = cfg
        self.config_path = config_path
        self.resume = resume
        self.hold = hold  # a reason to start the run paused (its stages ready, no step) until resumed; "" = none
        self.held_by_alert = ""  # the reason of a hold an alert set, which --resume leaves in place
        self.run_dir = cfg.run_dir
        self.children: list[Child] = []
        self.broker: RunBroker | None = None
        self.env: dict[str, str] = {}
        self.startup = StartupRecord(self.run_dir, launched_at=time.time())
        self.restart_policy = RestartPolicy(cfg.supervision)
        # name -> restarts over the whole run (nats-server's too); run.json shows it
        self.restarts: dict[str, int] = self.restart_policy.total
        self.crash_loops = CrashLoopGuard()
        self.last_step = 0  # the newest step row read: a restarted role that saw a later one made progress
        self.credentials = RunCredentials(self.run_dir)  # issued afresh at start()
        self.events = EventLog.of_run(cfg)
        self.usage = UsageMeter()
        self._usage_sampled = 0.0
        self.warm = WarmForks(cfg, self.events, console, inherited_env)
        self.presence: PresenceWatch | None = None
        self.record = RunRecord.of_run(cfg)
        self.scaler: ReplicaScaler  # made at start(), once the placement has decided the rollout replicas
        # How many rollout replicas, and what each role needs to share a GPU (rollout.replicas: auto); decided at
        # start() unless given.
        self.placement = placement

    def role_env(self, role: str) -> dict[str, str]:
        """What ``role`` is given at its start and each restart: its credentials (RunCredentials.role_env) and
        where it runs on a shared GPU."""
        env = self.credentials.role_env(role)
        if self.placement is not None:
            env.update(self.placement.env())
        return env

    def spawn(self, role: str, name: str, env: dict[str, str] | None = None) -> Child:
        log_path = self.run_dir / "logs" / f"{name}.log"
        command = [sys.executable, "-m", f"services.{role}", "--config", str(self.config_path)]
        if role == "trainer" and self.cfg.trainer.nproc > 1:
            command, env = trainer_command(self.cfg, command), {**trainer_env(self.cfg), **(env or {})}
        child_env = {**self.env, "RLPIPE_SERVICE__INSTANCE": name, **self.role_env(role), **(env or {})}
        process = self.warm.spawn(command, child_env) or subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=child_env,
            preexec_fn=dies_with_this_process(),
        )
        child = Child(name, role, process, log_path, self.cfg.service.log_max_mib * 2**20, self.cfg.service.log_keep)
        child.step_at_spawn = self.last_step
        child.echo = echo_alert
        child.pump_thread = threading.Thread(target=child.pump, args=(process.stdout,), daemon=True)
        child.pump_thread.start()
        self.children = [c for c in self.children if c.name != name] + [child]
        return child

    def close_presence(self) -> None:
        if self.presence is not None:
            self.presence.close()
            self.presence = None

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
        if (warm := self.warm.pid) is not None:  # the imports it spent for every role
            pids[warm] = "warm-start"
        self.usage.sample(pids, now)

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def started_broker(self) -> RunBroker:
        """The run's broker, which ``start`` started."""
        if self.broker is None:
            raise RuntimeError("the run's broker is not started: Launcher.start comes first")
        return self.broker

    def write_run_file(self) -> None:
        write_run_file(
            self.run_dir,
            self.cfg.run_id,
            self.env["RLPIPE_NATS__URL"],
            self.started_broker().pid,
            self.children,
            self.restarts,
        )

    def wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = list(children)
        while waiting:
            self.log_run_events(console)  # a trainer restores its run (resume, a hold) before it is ready
            # Starting counts too, and a short run's trainer can be done before follow() samples it.
            self.sample_usage()
            if self.record.done and all(child.role != "trainer" for child in waiting):
                return  # the trainer finished already (a resumed run at its last step): no stage is needed
            for child in list(waiting):
                if child.process.poll() is not None and self.presence is not None:
                    # What it wrote before it exited may not have been read yet: a process that became ready and
                    # then exited (a stage crashing on its first batch) is follow()'s to restart, not a failed start.
                    self.presence.await_reading(timeout_s=5.0)
                if self.note_ready(child):
                    console.log(
                        f"[green]{child.name} ready[/] {self.startup[child.name]:.1f}s after the launch "
                        + startup_fields(child.report())
                    )
                    waiting.remove(child)
                    continue
                if child.process.poll() == EXIT_REFUSED:
                    raise RoleRefused(child)
                if child.process.poll() is not None:
                    raise RuntimeError(
                        f"{child.name} exited with {child.process.returncode} before it was ready; see {child.log_path}"
                    )
            if time.monotonic() > deadline:
                unread = (
                    f"; presence not read: {self.presence.last_error}"
                    if self.presence and self.presence.last_error
                    else ""
                )
                raise RuntimeError(f"not ready after {READY_TIMEOUT_S:.0f}s: {[c.name for c in waiting]}{unread}")
            time.sleep(0.05)

    def note_ready(self, child: Child) -> bool:
        """Whether ``child`` became ready just now: its presence entry carries its start-up report (then its
        endpoints and load times are kept, recorded in startup.jsonl the first time, and put in run.json)."""
        if child.ready is not None or self.presence is None:
            return False
        entry = self.presence.ready_entry(child.role, child.name, child.process.pid, child.spawned_at)
        if entry is None:
            return False
        endpoints = {name: getattr(entry, name) for name in ("grpc", "admin", "metrics_url") if getattr(entry, name)}
        child.ready = {**entry.startup, **endpoints}
        if child.name not in self.startup:
            self.startup.record(child.name, child.ready)
        return True

    def log_run_events(self, out: Console) -> None:
        """What happened to the run since the last call (operators' actions, alerts), from ``events.jsonl``;
        the launcher's own restarts it has said already."""
        for event in self.record.new_events():
            if event.kind not in LAUNCHER_SAYS:
                out.log(f"{event.kind}: {event_summary(event)}")

    def start(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.warm.start()
        # Fresh credentials at every start: a key of an earlier run of this directory opens nothing.
        self.credentials = RunCredentials.issue(self.run_dir)
        nats_keys = self.credentials.nats_keys
        self.broker = RunBroker(self.cfg, nats_keys)
        nats_url = self.broker.start()
        self.presence = PresenceWatch(self.cfg, nats_url, nats_keys["operator"].seed_file).start()
        self.startup.record("nats", {"url": nats_url, "store": str(self.run_dir / "nats")})
        console.log(f"[green]nats ready[/] at {nats_url} {self.startup['nats']:.1f}s after the launch")
        if self.resume:
            self.held_by_alert = held_on_resume(self.broker.release_hold(), self.run_dir)
            # This start runs the config's replica counts, not those asked for in the last one.
            forget_scale_requests(self.cfg, nats_url, nats_keys["trainer"])
        if self.hold:
            self.broker.hold(self.hold)
        if self.placement is None:
            self.placement = place_roles(self.cfg, inherited_env().get("CUDA_VISIBLE_DEVICES"))
        started = {
            "rollout": self.placement.rollout_replicas,
            "reward": self.cfg.reward.replicas,
            "reference": self.cfg.reference.replicas,
        }
        self.scaler = ReplicaScaler(started, self.events, console)
        # Only the roles that need a token are given it (role_env); no service inherits one from this shell.
        self.env = {**inherited_env(), "RLPIPE_NATS__URL": nats_url, **LAUNCHER_SCALES}
        # Every role at once: the trainer creates the run's streams and buckets, which the others wait for (any
        # start order works, docs/architecture.md), so their model and engine loads overlap the trainer's. The
        # trainer binds ports the OS picks (two local runs must not collide on the defaults), or the admin port
        # the config names; restarted services then use the ports it got.
        admin_port = self.cfg.admin.port if "port" in self.cfg.admin.model_fields_set else 0
        ports = {"RLPIPE_SERVICE__TRAINER_GRPC_PORT": "0", "RLPIPE_ADMIN__PORT": str(admin_port)}
        # A fresh run must not pick up an older run's checkpoints under the same run id; restarts resume.
        trainer = self.spawn("trainer", "trainer", env={**ports, "RLPIPE_CHECKPOINT__RESUME": str(self.resume).lower()})
        others = [self.spawn("reference", f"reference-{i}") for i in range(started["reference"])]
        others += [self.spawn("reward", f"reward-{i}") for i in range(started["reward"])]
        # Port 0: a rollout reads the trainer's port from its presence entry once it has loaded its engine.
        others += [
            self.spawn("rollout", f"rollout-{i}", env={"RLPIPE_SERVICE__TRAINER_GRPC_PORT": "0"})
            for i in range(started["rollout"])
        ]
        self.wait_ready([trainer])
        # A restarted rollout or trainer is given the port the trainer got.
        self.env["RLPIPE_SERVICE__TRAINER_GRPC_PORT"] = trainer.report()["grpc"].rpartition(":")[2]
        self.env["RLPIPE_ADMIN__PORT"] = trainer.report()["admin"].rpartition(":")[2]
        self.wait_ready(others)
        self.write_run_file()
        console.log(
            "operate it from another shell: rlpipe status | pause | resume | config set KEY=VALUE | rollback STEP | "
            f"scale ROLE N | stop (admin at {self.child('trainer').report()['admin']})"
        )
        held = self.held_by_alert or self.hold
        if held:
            resume = f"rlpipe --run-dir {self.run_dir} resume"
            console.log(f"[yellow]held ({escape(held)})[/]: no step until it is resumed (`{resume}`)")

    def follow(self) -> RunDone | None:
        """Progress over training steps until the trainer is done, restarting services that die."""
        due: dict[str, float] = {}  # name -> when to restart it
        broker = self.started_broker()
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
            while True:
                # Whether the trainer had exited before its record is read: a trainer that is done wrote so first.
                trainer_exited = self.child("trainer").process.poll() is not None
                for child in self.children:
                    if self.note_ready(child):
                        self.write_run_file()  # a restarted service's new endpoints
                # The events first: the trainer wrote every metrics row before its done, so the rows read after it
                # include the last step's.
                self.log_run_events(progress.console)
                steps, evaluations = self.record.new_steps()
                for row in steps:
                    self.last_step = max(self.last_step, row.step or 0)
                    if "first step" not in self.startup:
                        self.startup.record("first step", {"step": row.step})
                        self.usage.settle()  # what steps allocate is allocated: memory from here on is judged
                    info = f"reward {row[m.REWARD_MEAN]:.3f}  entropy {row[m.ENTROPY]:.3f}  kl {row[m.KL_REF]:.4f}"
                    progress.update(task, completed=row.step, info=info)
                for row in evaluations:
                    progress.console.log(f"eval at step {row.step}: accuracy {row[m.EVAL_ACCURACY]:.3f}")
                if self.record.done:
                    break
                if trainer_exited and (pump := self.child("trainer").pump_thread) is not None:
                    pump.join(timeout=5)  # its last lines (a refusal) may be in the pipe
                if (broker_exit := broker.exit_code()) is not None:
                    # Same port and store: streams, consumers and unacked messages come back; clients reconnect.
                    self.restarts["nats"] = self.restarts.get("nats", 0) + 1
                    self.events.write(
                        Event.RESTART,
                        f"nats-server exited with {broker_exit}; restarting it",
                        service="nats",
                        restarts=self.restarts["nats"],
                    )
                    progress.console.log(f"[yellow]nats-server exited with {broker_exit}[/]; restarting it")
                    broker.start()
                    self.write_run_file()
                self.sample_usage()
                self.scale()
                for child in self.children:
                    # A trainer that exited after its record was read may have written done: read it first.
                    exited = trainer_exited if child.role == "trainer" else child.process.poll() is not None
                    if exited and child.name not in due and self.scaler.wanted(child.name):
                        due[child.name] = self.schedule_restart(child, progress)
                for name, when in list(due.items()):
                    if not self.scaler.wanted(name) or all(c.name != name for c in self.children):
                        del due[name]  # scaled away while it waited for its restart
                    elif time.monotonic() >= when:
                        del due[name]
                        restarted = self.child(name)
                        self.spawn(restarted.role, name, env=restart_env(restarted))
                        self.write_run_file()
                time.sleep(0.1)
        self.child("trainer").process.wait(timeout=60)
        return self.record.done

    def scale(self) -> None:
        """Start and stop stage replicas until each role has the count ``rlpipe scale`` asked for
        (services/cli/launch/scaling.py); a replica scaled away leaves run.json and the presence bucket once it
        has exited, and its name's restart history goes with it."""
        if self.presence is None:
            return
        # A replica scaled away gets its whole grace even if its ready entry was not read yet: it may have announced
        # itself and taken a batch since the watch's last look, and a SIGKILL would cost that batch a delivery.
        step = self.scaler.follow(self.presence.scale_records(), self.children, self.cfg.supervision.stop_grace_s)
        for role, name in step.start:
            self.spawn(role, name)
        for child in step.gone:
            self.children = [c for c in self.children if c is not child]
            self.restart_policy.recent.pop(child.name, None)
            self.crash_loops.last.pop(child.name, None)
        url, keys = self.env["RLPIPE_NATS__URL"], self.credentials.nats_keys
        self.scaler.forget_departed(lambda role, name: forget_presence(self.cfg, url, keys[role], name))
        if step.start or step.gone:
            self.write_run_file()

    def schedule_restart(self, child: Child, progress: Progress) -> float:
        """When to restart ``child``, which exited; raises RuntimeError when it died too often too fast, or
        refused to run (exit EXIT_REFUSED): restarting it would fail alike, or resume a run it refused."""
        supervision = self.cfg.supervision
        if child.process.returncode == EXIT_REFUSED:
            raise RoleRefused(child)
        if child.pump_thread is not None:
            child.pump_thread.join(timeout=5)  # its crashed event may still be in the pipe
        progressed = self.last_step > child.step_at_spawn
        if (crash := self.crash_loops.repeated(child.name, child.crash, progressed)) is not None:
            loop = RoleCrashLoop(child, crash)
            self.events.write(Event.CRASH_LOOP, str(loop), service=child.name, error=crash.error)
            raise loop
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

    def stop(self) -> list[str]:
        """Stop every process, each after its own grace (stopping.py); returns the services that failed."""
        return stop_children(self)

    def kill(self) -> list[str]:
        """SIGKILL every process at once (stopping.py); returns the services it killed."""
        return kill_children(self)
