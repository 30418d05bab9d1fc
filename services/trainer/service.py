"""Trainer: feeds PROMPTS, reads EXPERIENCE in stream order, updates the policy, serves its weights.

It is the only stateful role. It controls staleness by how many prompt groups it
lets be in flight (``max_inflight_batches * batch_size``); a group leaves flight
when its experience arrives or when it is dead-lettered on the way.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml
from nats.errors import Error as NatsError

from services.common.bus import (
    DEAD,
    EXPERIENCE,
    H_GROUP,
    PROMPTS,
    WORK_QUEUES,
    Bus,
    StoreUnavailable,
    StreamReader,
    stream_name,
    subject,
)
from services.common.config import AdminCredentials, BuildInfo, RunConfig, redacted_dump
from services.common.datasets import load_jsonl
from services.common.evaluation import greedy_accuracy
from services.common.events import EventLog
from services.common.live_config import LiveConfig
from services.common.logs import Stopwatch, bind_log_fields, log_event
from services.common.messages import DecodeError, ExperienceGroup, Prompt
from services.common.pb import admin_pb2, admin_pb2_grpc, weights_pb2_grpc
from services.common.presence import Presence, read_presence, roles_down
from services.common.service import start_grpc_server
from services.common.storage import open_store
from services.common.telemetry import StageMetrics, TrainerMetrics, current_telemetry, span_from_headers
from services.common.weightsync import WeightSyncServer, snapshot_of
from services.trainer.admin import AdminServicer, BearerToken
from services.trainer.alerts import AlertEvaluator, Firing, post_webhook
from services.trainer.checkpoint import (
    ABANDONED,
    STABLE,
    UNREADABLE,
    Checkpoint,
    CheckpointCorrupt,
    CheckpointStore,
    detached_copy,
)
from services.trainer.learner import Learner
from services.trainer.lineage import Lineage

log = logging.getLogger(__name__)
HEALTH_CHECK_S = 5.0  # how often alerts look at service presence and absent metrics between steps
ROLE_STARTUP_GRACE_S = 300.0  # a role may take this long to register its first replica (image pulls, engine loads)


class PromptFeeder:
    """Walks the dataset epoch by epoch in a seeded order; its cursor is (epoch, index)."""

    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool):
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next(self) -> Prompt:
        row = self.rows[self._order[self.index]]
        prompt = Prompt(
            group_id=f"e{self.epoch}-i{self.index}",
            prompt_id=str(row.get("id", self._order[self.index])),
            prompt=row["prompt"],
            answer=str(row.get("answer", "")),
        )
        self.index += 1
        if self.index == len(self.rows):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._order_of(self.epoch)
        return prompt

    @property
    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, cursor: dict[str, int]) -> None:
        self.epoch, self.index = cursor["epoch"], cursor["index"]
        self._order = self._order_of(self.epoch)


class MetricsLog:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps({"time": round(time.time(), 3), **row}) + "\n")


class Trainer:
    def __init__(self, cfg: RunConfig, bus: Bus, learner: Learner, weights: WeightSyncServer, live: LiveConfig):
        self.cfg = cfg
        self.bus = bus
        self.learner = learner
        self.weights = weights
        self.live = live
        self.resumed = False  # set by prepare()
        self.feeder = PromptFeeder(load_jsonl(cfg.data.train_path), cfg.train.seed, cfg.data.shuffle)
        self.eval_rows = load_jsonl(cfg.data.eval_path)[: cfg.data.eval_size] if cfg.data.eval_path else []
        mirror = open_store(cfg.checkpoint.mirror_url, cfg.checkpoint) if cfg.checkpoint.mirror_url else None
        self.checkpoints = CheckpointStore(
            open_store(cfg.checkpoint_url, cfg.checkpoint), cfg.run_id, cfg.checkpoint.keep_last, mirror=mirror
        )
        self.metrics = MetricsLog(cfg.metrics_file)
        self.events = EventLog(cfg.run_dir / "events.jsonl")
        self.lineage = Lineage(cfg.run_dir / "lineage.jsonl")
        self.alerts = AlertEvaluator(cfg.alerts.rules, cfg.alerts.cooldown_steps)
        self.build = BuildInfo().resolved()
        self.telemetry = TrainerMetrics()
        self.experience_lag = StageMetrics("trainer", EXPERIENCE)
        self.presence: Presence | None = None
        self.in_flight: set[str] = set()
        self.step = 0
        self.version = 0
        self.last_experience_seq = 0  # every EXPERIENCE message up to here is applied, dropped or dead
        self.abandoned_versions: list[tuple[int, int]] = []  # policy versions a rollback disowned
        self.last_eval: float | None = None
        self.baseline_eval: float | None = None
        self.saved_step = 0
        self.upload: asyncio.Task | None = None
        self.last_row: dict[str, Any] = {}
        self.claim_keys: list[tuple[int, str]] = []  # claim-checked EXPERIENCE bodies read, by sequence
        # Operator control: commands run between steps, in the training loop's own task.
        self.state = "running"
        self.paused_reason = ""
        self.stop_reason = ""
        self.commands: asyncio.Queue[tuple[Callable[[], Any], asyncio.Future]] = asyncio.Queue()
        self.wakeup = asyncio.Event()
        self.reader: StreamReader | None = None
        self.services: list[dict[str, Any]] = []
        self.lag: dict[str, int] = {}  # consumer lag per role, read with the services
        self.services_read = 0.0
        self.health_checked = 0.0
        self.created = time.monotonic()
        self.alert_rollbacks: dict[str, int] = {}  # rule -> the step its last rollback went to

    # -- operator commands ------------------------------------------------------------

    async def call(self, command: Callable[[], Any]) -> Any:
        """Run ``command`` in the training loop between steps and return its result (or raise its error)."""
        done = asyncio.get_running_loop().create_future()
        await self.commands.put((command, done))
        self.wake()
        return await done

    def wake(self) -> None:
        """Make the loop look at commands and config now instead of finishing the batch it is collecting."""
        self.wakeup.set()

    async def run_commands(self) -> None:
        self.wakeup.clear()
        while not self.commands.empty():
            command, done = self.commands.get_nowait()
            if done.cancelled():  # the caller's deadline passed or it hung up: a retry must not find it done twice
                log_event(log, "command_skipped", level=logging.WARNING, reason="caller gone")
                continue
            try:
                result = command()
                if asyncio.iscoroutine(result):
                    result = await result
            except Exception as error:  # the caller gets it; training goes on
                if not done.done():
                    done.set_exception(error)
            else:
                if not done.done():
                    done.set_result(result)

    async def pause(self, reason: str) -> None:
        """Hold training; kept in the run's config bucket so a restarted trainer stays paused."""
        if self.state == "running":
            self.state, self.paused_reason = "paused", reason
            self.events.write("pause", reason, step=self.step)
            log_event(log, "paused", step=self.step, reason=reason)
            await self._remember_pause()

    async def unpause(self) -> None:
        self.alert_rollbacks.clear()  # the operator has looked: rules may roll back again
        if self.state == "paused":
            self.state, self.paused_reason = "running", ""
            self.alerts.restart_absence_clocks(time.time())  # no step was due while paused
            self.events.write("unpause", "resumed by operator", step=self.step)
            log_event(log, "unpaused", step=self.step)
            await self._remember_pause()

    async def _remember_pause(self, reason: str | None = None) -> None:
        held = self.state != "running"
        try:
            await self.live.put_control({"paused": held, "reason": reason or self.paused_reason})
        except Exception as error:  # the broker's failures: the pause holds in this process regardless
            log_event(log, "control_not_stored", level=logging.WARNING, error=repr(error)[:200])

    async def restore_pause(self) -> None:
        control = await self.live.get_control()
        if control.get("paused"):
            self.state, self.paused_reason = "paused", f"{control.get('reason', '')} (still paused after a restart)"
            log_event(log, "paused", step=self.step, reason=self.paused_reason)

    async def request_stop(self, reason: str) -> None:
        """Drain and end the run. An orchestrator that restarts the trainer anyway (Kubernetes) gets it back paused."""
        self.state, self.stop_reason = "stopping", reason
        self.events.write("stop", reason, step=self.step)
        log_event(log, "stop_requested", step=self.step, reason=reason)
        await self._remember_pause(f"stopped: {reason}")

    async def checkpoint_now(self) -> dict[str, Any] | None:
        """Store the current step (unless it already is) and describe it; None if the save failed."""
        if self.saved_step != self.step or self.step not in await asyncio.to_thread(self.checkpoints.steps):
            await self.save(wait=True)
        return await self._catalog_entry(self.step)

    async def _catalog_entry(self, step: int) -> dict[str, Any] | None:
        return next((e for e in await self.list_checkpoints() if e["step"] == step), None)

    async def list_checkpoints(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.checkpoints.catalog)

    async def mark_stable(self, step: int) -> dict[str, Any]:
        """Run between steps (``call``): never beside a save of the same step, which rewrites its folder."""
        if self.upload is not None and not self.upload.done():
            await self.upload
        await asyncio.to_thread(self.checkpoints.mark, step, STABLE)
        log_event(log, "marked_stable", step=step)
        return await self._catalog_entry(step)

    async def rollback(self, step: int | None, reason: str) -> tuple[int, int, list[int]]:
        """Serve checkpoint ``step`` (None: the newest stable one) as a new policy version.

        The steps after it are recorded as abandoned, and so are the policy versions they
        produced: groups those versions generated are dropped when they arrive. EXPERIENCE is
        re-read from the checkpoint's sequence, so the groups the abandoned steps trained on
        are applied again (or dropped, if an abandoned version made them): each group is still
        accounted for exactly once in the steps that make up the model.
        """
        if self.upload is not None and not self.upload.done():
            await self.upload  # a save of the state being abandoned must land before it is marked
        stored = await asyncio.to_thread(self.checkpoints.steps)
        if step is None:
            step = await asyncio.to_thread(self.checkpoints.latest_stable)
            if step is None:
                raise LookupError("no checkpoint is marked stable (rlpipe mark-stable STEP)")
        elif step not in stored:
            raise LookupError(f"no stored checkpoint at step {step} (stored: {stored})")
        try:
            ckpt = await asyncio.to_thread(self.checkpoints.load, step)
        except UNREADABLE as error:
            raise CheckpointCorrupt(
                f"the checkpoint of step {step} cannot be loaded ({error}); nothing was changed"
            ) from error
        disowned = (ckpt.state["policy_version"] + 1, self.version)
        self.learner.load(ckpt)
        self.learner.reconfigure(self.cfg)  # the live hyperparameters stay in force
        self.step = self.saved_step = step
        self.last_experience_seq = ckpt.state["last_experience_seq"]
        self.last_eval = ckpt.state["eval_accuracy"]
        self.version = max(self.version, self.lineage.max_version()) + 1
        abandoned = self.lineage.restart_from(step, self.version, "rollback", abandoned_versions=disowned)
        self.abandoned_versions.append(disowned)
        for later in stored:
            if later > step:
                await asyncio.to_thread(self.checkpoints.mark, later, ABANDONED)
        await self.weights.publish(snapshot_of(self.learner.model, self.version, self.step))
        self.reader = self.bus.read_from(EXPERIENCE, self.last_experience_seq + 1)
        message = f"rolled back to step {step} as policy version {self.version} ({reason}); abandoned steps {abandoned[:1]}..{abandoned[-1:]}"
        self.events.write(
            "rollback", message, step=step, policy_version=self.version, abandoned_steps=abandoned, reason=reason
        )
        log_event(log, "rolled_back", step=step, policy_version=self.version, abandoned_steps=abandoned, reason=reason)
        return step, self.version, abandoned

    # -- status -----------------------------------------------------------------------

    async def refresh_services(self, max_age_s: float = 5.0) -> list[dict[str, Any]]:
        if time.monotonic() - self.services_read > max_age_s:
            try:
                self.services = await read_presence(self.bus.js, self.cfg)
                self.lag = await self.consumer_lag()
                self.services_read = time.monotonic()
                self.experience_lag.lag(self.lag.get("trainer", 0))
            except (NatsError, TimeoutError) as error:
                log_event(log, "presence_unreadable", level=logging.WARNING, error=repr(error)[:200])
        return self.services

    async def consumer_lag(self) -> dict[str, int]:
        """Messages waiting per consuming role: pending plus unacknowledged on its work queue; the trainer's unread EXPERIENCE."""
        lag = {}
        for edge, role in WORK_QUEUES.items():
            try:
                info = await self.bus.js.consumer_info(stream_name(self.cfg.run_id, edge), role)
                lag[role] = info.num_pending + info.num_ack_pending
            except (NatsError, TimeoutError):
                continue
        try:
            info = await self.bus.js.stream_info(stream_name(self.cfg.run_id, EXPERIENCE))
            lag["trainer"] = max(info.state.last_seq - self.last_experience_seq, 0)
        except (NatsError, TimeoutError):
            pass
        return lag

    async def status(self) -> admin_pb2.Status:
        services = await self.refresh_services(max_age_s=1.0)
        lag = self.lag
        store_error = ""
        try:
            catalog = await self.list_checkpoints()
        except Exception as error:  # an operator needs status most while something is down
            catalog, store_error = [], f"{type(error).__name__}: {error}"[:300]
        live_steps = [e["step"] for e in catalog if not e["abandoned"]]
        stable = [e["step"] for e in catalog if e["stable"] and not e["abandoned"]]
        return admin_pb2.Status(
            run_id=self.cfg.run_id,
            state=self.state,
            paused_reason=self.paused_reason,
            step=self.step,
            total_steps=self.cfg.train.total_steps,
            policy_version=self.version,
            config_version=self.live.version,
            last_checkpoint_step=max(live_steps, default=-1),
            last_stable_step=max(stable, default=-1),
            services=[
                admin_pb2.ServiceStatus(
                    instance=e["instance"],
                    role=e["role"],
                    grpc_address=e.get("grpc", ""),
                    metrics_url=e.get("metrics_url", ""),
                    pid=e.get("pid", 0),
                    config_version=e.get("config_version", 0),
                    policy_version=e.get("policy_version", 0),
                    restarts=e["restarts"],
                    consumer_lag=lag.get(e["role"], 0),
                    last_seen_s=e["last_seen_s"],
                    up=e["up"],
                    build_version=e.get("build_version", ""),
                    build_revision=e.get("build_revision", ""),
                )
                for e in services
            ],
            alerts=[admin_pb2.Alert(**_alert_fields(f)) for f in self.alerts.active],
            build_version=self.build.version,
            build_revision=self.build.revision,
            in_flight_groups=len(self.in_flight),
            last_eval_accuracy=self.last_eval if self.last_eval is not None else -1.0,
            environment=self.cfg.environment or "",
            checkpoint_store_error=store_error,
        )

    # -- live config and alerts -----------------------------------------------------

    async def apply_live_config(self, force: bool) -> None:
        """Put the newest config version in force; ``force`` reads the bucket now rather than at the next poll."""
        await self.live.refresh(force=force)
        if self.live.cfg is self.cfg:
            return
        previous, self.cfg = self.cfg, self.live.cfg
        self.learner.reconfigure(self.cfg)
        self.checkpoints.keep_last = self.cfg.checkpoint.keep_last
        if self.cfg.alerts != previous.alerts:
            self.alerts.replace_rules(self.cfg.alerts.rules, self.cfg.alerts.cooldown_steps)
        version = self.live.current
        self.events.write(
            "config_change",
            f"config version {version.version} by {version.author}: "
            + ", ".join(f"{c.key}={c.new}" for c in version.changes),
            step=self.step,
            config_version=version.version,
            changes=[vars(c) for c in version.changes],
        )

    async def watch(self, row: dict[str, Any]) -> None:
        """Feed a metrics row to the alert rules and carry out what fires."""
        if not self.cfg.alerts.enabled:
            return
        now = time.time()
        firings = self.alerts.observe(row, now)
        if self.state == "running":  # paused or stopping, no step is due: its metrics are not absent
            firings += self.alerts.check_absent(now)
        for firing in firings:
            await self.act_on(firing)

    async def check_health(self) -> None:
        """Every few seconds, also while no step comes (a stalled pipeline, a pause): the services_down
        status row and the absent-metric rules, which must not wait for a step to be judged."""
        if time.monotonic() - self.health_checked < HEALTH_CHECK_S:
            return
        self.health_checked = time.monotonic()
        services = await self.refresh_services()
        await self.watch({"step": self.step, "services_down": float(len(self.roles_down(services)))})

    def roles_down(self, services: list[dict[str, Any]]) -> list[str]:
        """Roles without a live replica; one that has never registered counts once the start-up grace is over."""
        return roles_down(services, count_unseen=time.monotonic() - self.created > ROLE_STARTUP_GRACE_S)

    async def act_on(self, firing: Firing) -> None:
        taken = []
        for action in firing.actions:
            if action == "pause":
                await self.pause(f"alert {firing.rule}: {firing.message}")
            elif action == "stop":
                await self.request_stop(f"alert {firing.rule}: {firing.message}")
            elif action == "rollback":
                # Between steps, like an operator's rollback: never in the middle of this step's bookkeeping.
                self.commands.put_nowait(
                    (lambda: self.rollback_for(firing), asyncio.get_running_loop().create_future())
                )
                self.wake()
            taken.append(action)
        details = {**firing.as_dict(), "actions_taken": taken}
        self.telemetry.record_alert(firing.rule, firing.severity)
        self.events.write(
            "alert",
            firing.message,
            step=firing.step,
            **{k: v for k, v in details.items() if k not in ("message", "step", "time")},
        )
        self.metrics.write(
            {
                "step": self.step,
                "alert": firing.rule,
                "alert_severity": firing.severity,
                "config_version": self.live.version,
            }
        )
        log_event(
            log,
            "alert",
            level=logging.ERROR if firing.severity == "critical" else logging.WARNING,
            alert=True,
            **details,
        )
        if self.cfg.alerts.webhook_url:
            post_webhook(self.cfg.alerts.webhook_url, {"run_id": self.cfg.run_id, **details})

    async def rollback_for(self, firing: Firing) -> None:
        """An alert's rollback: to the newest stable step, else the newest one saved before the rule's window; else pause.

        Nobody awaits an alert's command, so a failure holds the run for an operator instead of raising."""
        try:
            await self._rollback_for(firing)
        except Exception as error:
            log_event(
                log, "alert_rollback_failed", level=logging.ERROR, alert=True, rule=firing.rule, error=repr(error)[:500]
            )
            await self.pause(f"alert {firing.rule}: rollback failed: {error}")

    async def _rollback_for(self, firing: Firing) -> None:
        rule = next((r for r in self.cfg.alerts.rules if r.name == firing.rule), None)
        before = (firing.step if firing.step is not None else self.step) - (rule.window_steps if rule else 1)
        target = await asyncio.to_thread(self.checkpoints.latest_stable)
        if target is None:
            target = max((s for s in await asyncio.to_thread(self.checkpoints.steps) if s <= before), default=None)
        if target is None:
            await self.pause(
                f"alert {firing.rule}: no stable checkpoint and none from before step {before} to roll back to"
            )
            return
        if self.alert_rollbacks.get(firing.rule) == target:
            # The same trouble right after going back to the same step: another rollback would loop.
            await self.pause(
                f"alert {firing.rule}: fired again after rolling back to step {target}; waiting for an operator"
            )
            return
        self.alert_rollbacks[firing.rule] = target
        await self.rollback(target, reason=f"alert {firing.rule}")

    # -- training ---------------------------------------------------------------------

    def restore(self) -> int | None:
        """Continue from the configured or latest valid checkpoint; returns its step, or None for a fresh start."""
        wanted = self.cfg.checkpoint.resume_step
        ckpt = self.checkpoints.load(wanted) if wanted is not None else self.checkpoints.load_latest()
        if ckpt is None:
            return None
        self.learner.load(ckpt)
        self.learner.reconfigure(self.cfg)
        state = ckpt.state
        self.step = self.saved_step = state["step"]
        self.feeder.seek(state["data_cursor"])
        self.last_experience_seq = state["last_experience_seq"]
        self.in_flight = set(state["in_flight"])
        self.last_eval, self.baseline_eval = state["eval_accuracy"], state["baseline_accuracy"]
        # Versions only grow: rollouts must see the restored weights as new, whatever they hold now.
        self.version = max(state["policy_version"], self.lineage.max_version()) + 1
        abandoned = self.lineage.restart_from(self.step, self.version, "resume", copy_if_missing=ckpt.lineage)
        self.abandoned_versions = self.lineage.abandoned_versions()
        self.events.write("resume", f"resumed from step {self.step} as policy version {self.version}", step=self.step)
        log_event(
            log,
            "resumed",
            step=self.step,
            policy_version=self.version,
            experience_seq=self.last_experience_seq,
            abandoned_steps=abandoned,
        )
        return self.step

    async def feed(self) -> None:
        limit = self.cfg.train.max_inflight_batches * self.cfg.train.batch_size
        while len(self.in_flight) < limit:
            cursor = self.feeder.cursor
            prompt = self.feeder.next()
            prompt.config_version = self.live.version
            try:
                await self.bus.publish(PROMPTS, prompt, msg_id=f"{prompt.group_id}.prompt")
            except (NatsError, TimeoutError) as error:
                self.feeder.seek(cursor)  # publish it again later; a copy that did land is deduplicated
                log_event(log, "feed_failed", level=logging.WARNING, group_id=prompt.group_id, error=repr(error)[:300])
                return
            self.in_flight.add(prompt.group_id)

    async def on_dead_letter(self, msg: Any) -> None:
        if msg.headers and msg.headers.get(H_GROUP) in self.in_flight:
            self.in_flight.discard(msg.headers[H_GROUP])
            log_event(log, "group_lost_to_dead_letters", level=logging.WARNING, group_id=msg.headers[H_GROUP])

    async def release_dead_in_flight(self) -> None:
        """Groups dead-lettered while no trainer listened will never arrive: stop counting them as in flight."""
        reader = self.bus.read_from(DEAD, 1)
        while (msg := await reader.next(timeout=0.2)) is not None:
            await self.on_dead_letter(msg)

    def disowned(self, group: ExperienceGroup) -> bool:
        return any(low <= group.policy_version <= high for low, high in self.abandoned_versions)

    async def next_batch(self, stop: asyncio.Event) -> tuple[list[ExperienceGroup], list[str], int] | None:
        """The next ``batch_size`` usable groups in stream order, the ids dropped as stale, and the last sequence read.

        None when an operator command or config change interrupts: the partial batch is
        dropped and re-read from the last applied sequence after the command has run.
        """
        batch: list[ExperienceGroup] = []
        dropped: list[str] = []
        sequence = self.last_experience_seq
        while len(batch) < self.cfg.train.batch_size and not stop.is_set():
            if self.wakeup.is_set() or await self.live.refresh():
                self.reader = self.bus.read_from(EXPERIENCE, self.last_experience_seq + 1)
                return None
            await self.check_health()  # a batch that never completes must still raise its alerts
            await self.feed()
            msg = await self.reader.next(timeout=1.0)
            if msg is None:
                continue
            with span_from_headers(
                "trainer.experience", msg.headers, group_id=(msg.headers or {}).get(H_GROUP), seq=msg.sequence
            ):
                sequence = msg.sequence
                try:
                    group = await self.bus.decode(msg, ExperienceGroup)
                except DecodeError as error:
                    await self.bus.dead_letter(msg, str(error), EXPERIENCE)
                    continue
                except StoreUnavailable as error:  # read it again once the store answers; the partial batch too
                    log_event(log, "claim_unavailable", level=logging.WARNING, seq=msg.sequence, error=str(error))
                    await asyncio.sleep(2.0)
                    self.reader = self.bus.read_from(EXPERIENCE, self.last_experience_seq + 1)
                    return None
                if (claim := self.bus.claim_key(msg)) is not None:
                    self.claim_keys.append((msg.sequence, claim))
                self.in_flight.discard(group.group_id)
                max_staleness = self.cfg.train.max_staleness
                if self.disowned(group) or (
                    max_staleness is not None and self.version - group.policy_version > max_staleness
                ):
                    dropped.append(group.group_id)
                    continue
                batch.append(group)
        return batch, dropped, sequence

    async def evaluate(self) -> float | None:
        if not self.eval_rows:
            return None
        took = Stopwatch()
        accuracy = await asyncio.to_thread(
            greedy_accuracy,
            self.learner.model,
            self.learner.tokenizer,
            self.eval_rows,
            self.cfg.sampling.max_new_tokens,
        )
        self.last_eval = accuracy
        row = {
            "step": self.step,
            "policy_version": self.version,
            "config_version": self.live.version,
            "eval_accuracy": accuracy,
            "eval_time_s": took(),
        }
        self.metrics.write(row)
        await self.watch(row)
        log_event(log, "eval", step=self.step, eval_accuracy=accuracy, eval_s=took())
        return accuracy

    def checkpoint(self) -> Checkpoint:
        """A copy of everything to save, taken between steps so the upload can run while training goes on."""
        critic = self.learner.critic
        return Checkpoint(
            step=self.step,
            model=detached_copy(self.learner.model),
            optimizer=copy.deepcopy(self.learner.optimizer.state_dict()),
            scheduler=self.learner.scheduler.state_dict(),
            rng=self.learner.rng_state(),
            critic=detached_copy(critic) if critic is not None else None,
            lineage=self.lineage.text(),
            state={
                "step": self.step,
                "policy_version": self.version,
                "config_version": self.live.version,
                "data_cursor": self.feeder.cursor,
                "last_experience_seq": self.last_experience_seq,
                "in_flight": sorted(self.in_flight),
                "eval_accuracy": self.last_eval,
                "baseline_accuracy": self.baseline_eval,
                "metrics": self.last_row,
            },
            extras={
                # What produced these weights, for whoever restores or audits them.
                "config.yaml": yaml.safe_dump(redacted_dump(self.cfg), sort_keys=False).encode(),
                "build.json": json.dumps({"version": self.build.version, "revision": self.build.revision}).encode(),
            },
        )

    async def save(self, wait: bool = False) -> None:
        """Checkpoint in the background; with ``wait``, until it is stored (or has failed)."""
        if self.upload is not None and not self.upload.done():
            if not wait:
                log_event(
                    log,
                    "checkpoint_deferred",
                    level=logging.WARNING,
                    step=self.step,
                    reason="previous upload still running",
                )
                return
            await self.upload
            if self.saved_step == self.step:
                return  # that upload was this very step: saving it again would delete it first
        self.upload = asyncio.create_task(self._upload(self.checkpoint()))
        if wait:
            await self.upload

    async def _upload(self, ckpt: Checkpoint) -> None:
        took = Stopwatch()
        try:
            location = await asyncio.to_thread(self.checkpoints.save, ckpt, self.cfg.model.path)
        except Exception as error:  # the store's many failure types; training must go on
            row = {"step": ckpt.step, "checkpoint_failed": 1, "error": repr(error)[:500]}
            self.telemetry.record_checkpoint(took(), ok=False)
            self.metrics.write(row)
            log_event(
                log, "checkpoint_failed", level=logging.ERROR, alert=True, step=ckpt.step, error=repr(error)[:500]
            )
            await self.watch({**row, "step": self.step})  # the save's own step may be behind: not a rollback to it
            return
        seconds = took()
        self.telemetry.record_checkpoint(seconds, ok=True)
        self.saved_step = max(self.saved_step, ckpt.step)
        # checkpoint_failed 0 clears a checkpoint-failure alert that an earlier save raised.
        row = {"step": ckpt.step, "checkpoint_saved": 1, "checkpoint_failed": 0, "checkpoint_time_s": seconds}
        self.metrics.write(row)
        await self.watch({**row, "step": self.step})
        log_event(log, "checkpoint", step=ckpt.step, location=location, save_s=seconds)
        await self.purge_consumed()

    async def purge_consumed(self) -> None:
        """Drop the EXPERIENCE (and claim-checked bodies) that no kept checkpoint would re-read; the stream stays bounded."""
        try:
            floor = await asyncio.to_thread(self.checkpoints.replay_floor)
            if floor is None:
                return
            await self.bus.js.purge_stream(stream_name(self.cfg.run_id, EXPERIENCE), seq=floor + 1)
            doomed = [key for seq, key in self.claim_keys if seq <= floor]
            await asyncio.to_thread(self.bus.claims.delete, doomed)
        except Exception as error:  # the broker's or the store's failures; purging can wait for the next save
            log_event(log, "purge_failed", level=logging.WARNING, error=repr(error)[:300])
            return
        self.claim_keys = [(seq, key) for seq, key in self.claim_keys if seq > floor]
        log_event(log, "purged", experience_below=floor + 1, claims=len(doomed))

    async def train_step(self, batch: list[ExperienceGroup], dropped: list[str], sequence: int) -> None:
        train = self.cfg.train
        metrics = await asyncio.to_thread(self.learner.step, batch, self.version)
        self.step += 1
        self.version += 1
        self.last_experience_seq = sequence
        self.lineage.record_step(
            self.step, self.version, [(g.group_id, g.policy_version) for g in batch], dropped, sequence
        )
        await self.weights.publish(snapshot_of(self.learner.model, self.version, self.step))
        services = await self.refresh_services()
        row = {
            "step": self.step,
            "policy_version": self.version,
            "config_version": self.live.version,
            "dropped_stale": len(dropped),
            **metrics,
            "services_down": float(len(self.roles_down(services))),
        }
        self.last_row = row
        self.metrics.write(row)
        self.telemetry.record_step(row)
        bind_log_fields(step=self.step)
        if self.presence:
            self.presence.update(policy_version=self.version, step=self.step)
        if self.step % train.log_interval == 0:
            log_event(log, "step", total_steps=train.total_steps, **row)
        await self.watch(row)

    async def between_steps(self) -> None:
        woken = self.wakeup.is_set()  # an admin call just stored a config version, or queued a command
        await self.run_commands()
        await self.apply_live_config(force=woken)

    async def prepare(self) -> None:
        """Restore the latest checkpoint and any operator hold, before the trainer says it is ready:
        its first status and the first weights rollouts pull are those of the restored run."""
        self.resumed = self.cfg.checkpoint.resume and await asyncio.to_thread(self.restore) is not None
        if self.resumed:
            await self.weights.publish(snapshot_of(self.learner.model, self.version, self.step))
        await self.restore_pause()

    async def run(self, stop: asyncio.Event) -> None:
        data = self.cfg.data
        self.reader = self.bus.read_from(EXPERIENCE, self.last_experience_seq + 1)
        dead = await self.bus.nc.subscribe(subject(self.cfg.run_id, DEAD), cb=self.on_dead_letter)
        if self.resumed:
            await self.release_dead_in_flight()
        if not self.resumed:
            self.baseline_eval = await self.evaluate()
        while self.step < self.cfg.train.total_steps and not stop.is_set() and self.state != "stopping":
            await self.between_steps()
            if self.state != "running":
                try:
                    await asyncio.wait_for(self.wakeup.wait(), timeout=1.0)
                except TimeoutError:
                    await self.check_health()
                continue
            collected = await self.next_batch(stop)
            if collected is None:
                continue
            batch, dropped, sequence = collected
            if len(batch) < self.cfg.train.batch_size:
                break
            await self.train_step(batch, dropped, sequence)
            if self.cfg.checkpoint.save_every_steps and self.step % self.cfg.checkpoint.save_every_steps == 0:
                await self.save()
            if (
                data.eval_every_steps
                and self.step % data.eval_every_steps == 0
                and self.step < self.cfg.train.total_steps
            ):
                await self.evaluate()
        await dead.unsubscribe()
        await self.run_commands()  # answer whoever asked to stop
        if self.state == "stopping":
            if self.step > self.saved_step:
                await self.save(wait=True)
            self.state = "done"
            log_event(
                log,
                "done",
                steps=self.step,
                policy_version=self.version,
                baseline_accuracy=self.baseline_eval,
                final_accuracy=self.last_eval,
                stopped_by=self.stop_reason,
            )
            return
        if self.step < self.cfg.train.total_steps:
            # Stopped by a signal: keep what was applied (a partial batch was not, and will be re-read).
            if self.step > self.saved_step:
                await self.save(wait=True)
            log_event(log, "stopped_early", step=self.step)
            return
        final = await self.evaluate()
        await self.save(wait=True)
        self.state = "done"
        log_event(
            log,
            "done",
            steps=self.step,
            policy_version=self.version,
            baseline_accuracy=self.baseline_eval,
            final_accuracy=final,
        )


def _alert_fields(firing: Firing) -> dict[str, Any]:
    fields = firing.as_dict()
    return {
        name: fields[name]
        for name in admin_pb2.Alert.DESCRIPTOR.fields_by_name
        if name in fields and fields[name] is not None
    }


def record_run_start(cfg: RunConfig, build: BuildInfo, config_version: int) -> None:
    """What this trainer runs with, beside the run's metrics: the effective config (secrets redacted) and the build."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "effective-config.yaml").write_text(
        f"# config version {config_version}, rlpipe {build.version} ({build.revision})\n"
        + yaml.safe_dump(redacted_dump(cfg), sort_keys=False)
    )
    log_event(
        log,
        "build",
        version=build.version,
        revision=build.revision,
        config_version=config_version,
        environment=cfg.environment,
    )


def admin_token(cfg: RunConfig) -> str:
    token = AdminCredentials().token
    if not token and cfg.admin.token_file is not None:
        token = cfg.admin.token_file.read_text().strip()
    if not token:
        raise ValueError("no admin token: set RLPIPE_ADMIN_TOKEN or admin.token_file (rlpipe run generates one)")
    return token


async def start_admin_server(cfg: RunConfig, trainer: Trainer) -> tuple[Any, str]:
    """Admin on its own port (the one operators reach), behind the bearer token, TLS when configured."""
    credentials = None
    if cfg.admin.tls_cert is not None:
        credentials = grpc.ssl_server_credentials([(cfg.admin.tls_key.read_bytes(), cfg.admin.tls_cert.read_bytes())])

    def register(server: Any) -> list[str]:
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(trainer), server)
        return ["rlpipe.v1.Admin"]

    return await start_grpc_server(
        cfg, cfg.admin.port, register, interceptors=[BearerToken(admin_token(cfg))], credentials=credentials
    )


async def main(cfg: RunConfig, stop: asyncio.Event) -> None:
    started = Stopwatch()
    bus = await Bus(cfg, "trainer").connect()
    live = await LiveConfig(cfg, bus.js).start()
    learner = await asyncio.to_thread(Learner, cfg)
    model_s = started()
    weights = WeightSyncServer(snapshot_of(learner.model, version=0, step=0))

    def register(server: Any) -> list[str]:
        weights_pb2_grpc.add_WeightSyncServicer_to_server(weights, server)
        return ["rlpipe.v1.WeightSync"]

    server, address = await start_grpc_server(cfg, cfg.service.trainer_grpc_port, register)
    trainer = Trainer(cfg, bus, learner, weights, live)
    await trainer.prepare()
    record_run_start(cfg, trainer.build, live.version)
    admin_server, admin_address = await start_admin_server(cfg, trainer)
    trainer.presence = await Presence(bus.js, cfg, "trainer", live).start(
        grpc=address, admin=admin_address, metrics_url=current_telemetry().metrics_url
    )
    log_event(
        log,
        "ready",
        grpc=address,
        admin=admin_address,
        metrics_url=current_telemetry().metrics_url,
        model=str(cfg.model.path),
        model_load_s=model_s,
        startup_s=started(),
    )
    try:
        await trainer.run(stop)
        if trainer.saved_step < trainer.step:
            # Ending now would lose applied steps without a trace in the exit code; a restart re-does them.
            log_event(
                log, "ended_unsaved", level=logging.ERROR, alert=True, step=trainer.step, saved_step=trainer.saved_step
            )
            raise SystemExit(1)
    finally:
        await trainer.presence.stop()
        await admin_server.stop(grace=1)
        await server.stop(grace=1)
        await bus.close()
