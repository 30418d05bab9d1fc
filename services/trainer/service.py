"""Trainer: feeds PROMPTS, reads EXPERIENCE in stream order, updates the policy, serves its weights.

It is the only stateful role, and this module is only its loop (``role.py`` starts the process, takes the lease
and wires it): the components do the work and never reference the loop that drives them.

- ``intake``: feeding prompts, the ledger of what became of each group, reading EXPERIENCE;
- ``control``: operator commands and the running/paused/stopping state;
- ``recovery``: checkpoints, purging, and adopting a stored step (resume, rollback); its ``publisher`` copies and
  serves each new policy version in the background;
- ``responder``: metrics rows judged by the alert rules, and their actions;
- ``status``: services, lag and the Admin status reply;
- ``liveness``: the loop's heartbeat, which the gRPC health follows.

The loop also renews the trainer's lease (role.py), so it only schedules and waits: the learner's step, snapshots,
lineage appends, evaluations and weight copies run on worker threads, each awaited or backgrounded.

Staleness is bounded twice: by how many prompt groups are in flight
(``max_inflight_batches * batch_size``) and by ``max_staleness``, which drops groups made by
weights too old (a rollout that cannot pull new weights keeps sampling with the ones it has).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from services.common.config import RunConfig
from services.common.episodes.observations import observation_format
from services.common.model.chat import ChatTemplateError, prompt_text
from services.common.model.datasets import open_prompts, read_rows
from services.common.model.preprocess import Preprocessor
from services.common.observe.events import Event, EventLog, Journal
from services.common.observe.hardware import HardwareSampler
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.logs import Stopwatch, bind_log_fields, log_event
from services.common.observe.network import NetworkRates
from services.common.observe.timeshare import StageActivity, StepPhase, TimeShare
from services.common.observe.trackers import TrackerFanout
from services.common.refusal import StartRefused
from services.common.transport.bus import Bus
from services.common.transport.live_config import HoldSource, LiveConfig
from services.common.transport.messages import reward_part_means
from services.common.transport.presence import Presence
from services.common.transport.storage import open_store
from services.common.transport.streams import EXPERIENCE, BrokerStateLost
from services.common.transport.weightsync.server import WeightSyncServer
from services.trainer.alerts import AlertEvaluator
from services.trainer.checkpointing.lineage import Lineage
from services.trainer.checkpointing.recovery import Recovery
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.control import Control, RunState
from services.trainer.intake.episode_stats import episode_metrics
from services.trainer.intake.feeder import PromptFeeder
from services.trainer.intake.ledger import GroupLedger
from services.trainer.intake.reader import Collected, Intake
from services.trainer.intake.samples import SampleArchive
from services.trainer.learning.learner import Learner
from services.trainer.liveness import LoopHeartbeat
from services.trainer.progress import Progress
from services.trainer.responder import AlertResponder, AlertSink, MetricsLog
from services.trainer.served_versions import ServedVersions
from services.trainer.status import RefusalWatch, StatusReporter
from services.trainer.step_rows import LedgerRows, dynamic_sampling_row, step_time_row

log = logging.getLogger(__name__)
HEALTH_CHECK_S = 5.0  # how often alerts look at service presence and absent metrics between steps
# Without periodic checkpoints nothing else purges EXPERIENCE; a purge costs a store listing and a write.
PURGE_EVERY_STEPS_UNSAVED = 10


class Trainer:
    """Wires the components and drives them: collect a batch, train on it, publish, save, evaluate."""

    def __init__(
        self,
        cfg: RunConfig,
        bus: Bus,
        learner: Learner,
        weights: WeightSyncServer,
        live: LiveConfig,
        trackers: TrackerFanout | None = None,
        preprocessor: Preprocessor | None = None,
        served: ServedVersions | None = None,
    ):
        """``trackers``: telemetry.report_to's, opened by the caller (``open_trackers``, off the event loop: MLflow
        creates its database there, which can outlast the lease's TTL). ``preprocessor``: data.tokenize_workers'
        pool, started by the caller off the loop for the same reason (None: everything inline). ``served``: the
        run's served-version mark in the lease bucket (``Recovery``)."""
        self.cfg = cfg
        self.bus = bus
        self.learner = learner
        self.live = live
        self.progress = Progress()
        self.heartbeat = LoopHeartbeat(cfg.train.stall_bound_s)
        # Chat rows are rendered once with the model's template; every reader then sees the same prompt text.
        data = cfg.data
        eval_rows = read_rows(data.eval_path, data.columns, data.eval_split, data.eval_size) if data.eval_path else []
        self.preprocessor = preprocessor or Preprocessor(learner.tokenizer, cfg.model.folder)
        ahead = self.preprocessor.rendered_ahead if self.preprocessor.pool is not None else None
        try:  # a chat the model's template cannot render is the config's fault: refused at start, not crashed on
            self.eval_rows = self.preprocessor.render_rows(eval_rows)
            train_rows = open_prompts(
                data, render=partial(prompt_text, tokenizer=learner.tokenizer), render_ahead=ahead
            )
        except ChatTemplateError as error:
            raise StartRefused(str(error)) from None
        if self.eval_rows and cfg.rollout.multi_turn:
            try:  # the held-out episodes wrap observations as the rollouts do: a model that cannot is refused now
                observation_format(learner.tokenizer, cfg.rollout.observation_role)
            except ValueError as error:
                raise StartRefused(str(error)) from None
        self.lineage = Lineage(cfg.run_dir / "lineage.jsonl")
        self.samples = SampleArchive(cfg.run_dir / "samples", cfg.telemetry.samples_keep_steps)
        self.telemetry = TrainerMetrics()
        rolling = cfg.telemetry
        metrics = MetricsLog(
            cfg.metrics_file, trackers, rolling.jsonl_max_mib * 2**20, keep_parts=rolling.jsonl_keep_parts
        )
        self.journal = Journal(EventLog.of_run(cfg), [AlertSink(live, metrics, self.telemetry, self.progress)])
        self.ledger = GroupLedger()
        self.ledger_rows = LedgerRows(self.ledger, self.telemetry)
        self.feeder = PromptFeeder(train_rows, cfg.train.seed, data.shuffle)
        mirror = open_store(cfg.checkpoint.mirror_url, cfg.checkpoint) if cfg.checkpoint.mirror_url else None
        self.checkpoints = CheckpointStore(
            open_store(cfg.checkpoint_url, cfg.checkpoint),
            cfg.run_id,
            cfg.checkpoint.keep_last,
            mirror=mirror,
            compression=cfg.checkpoint.compression,
        )
        self.control = Control(live, self.journal, self.progress)
        self.intake = Intake(
            bus,
            self.feeder,
            self.ledger,
            self.progress,
            on_lost=self.record_lost,
            on_reopened=self.record_reopened,
            vocab_size=learner.model.config.vocab_size,
        )
        self.recovery = Recovery(
            live,
            learner,
            self.checkpoints,
            self.lineage,
            self.progress,
            self.ledger,
            self.feeder,
            weights,
            bus,
            self.journal,
            self.telemetry,
            report=self.report_row,
            rewind=self.intake.rewind,
            hold=lambda reason: self.control.pause(reason, by=HoldSource.ALERT),
            served=served,
        )
        self.alerts = AlertEvaluator(cfg.alerts.rules, cfg.alerts.cooldown_steps)
        self.responder = AlertResponder(
            live,
            self.alerts,
            self.control,
            self.checkpoints,
            rollback=self.recovery.rollback,
            progress=self.progress,
            metrics=metrics,
            journal=self.journal,
        )
        self.build = self.recovery.build
        self.status = StatusReporter(
            live, bus, self.progress, self.control, self.ledger, self.alerts, self.recovery.catalog, self.build
        )
        self.refusals = RefusalWatch(self.journal)
        self.hardware = HardwareSampler(learner.device)
        link = cfg.telemetry.link_mib_s
        self.network = NetworkRates("trainer", link * 2**20 if link else None)
        self.presence: Presence | None = None
        self.resumed = False  # set by prepare()
        self.health_checked = 0.0
        self.broker_lost: BrokerStateLost | None = None  # found by the check after a reconnect
        # Where the time between two step rows goes (time/<phase>_s in each row), and its sum over the run as
        # busy/idle/blocked in the presence entry, as the stages report theirs.
        self.step_time = TimeShare(StepPhase.BOOKKEEPING)
        self.time_spent = dict.fromkeys(StageActivity, 0.0)

    async def report_row(self, row: dict[str, Any]) -> None:
        """A row Recovery reports about a save goes where every metrics row goes: written, then judged by the alert
        rules. Routed here because the rules' rollback action is Recovery's own, so neither can hold the other."""
        await self.responder.report(row)

    async def prepare(self, claim: Callable[[], None] | None = None) -> None:
        """Restore the latest checkpoint and any operator hold before the trainer says it is ready:
        its first status and the first weights rollouts pull are those of the restored run. ``claim``: take the
        store's lease fence, before the first write to it (``Recovery.start``)."""
        self.resumed = await self.recovery.start(resume=self.cfg.checkpoint.resume, claim=claim)
        await self.control.restore_hold()

    # -- between steps ---------------------------------------------------------------

    async def between_steps(self) -> None:
        woken = self.control.wakeup.is_set()  # an admin call just stored a config version, or queued a command
        await self.control.run_commands()
        await self.apply_live_config(force=woken)
        if self.control.running:  # no step before an adopted step's weights reach the rollouts
            await self.recovery.serve_pending()

    async def apply_live_config(self, force: bool) -> None:
        """Put the newest config version in force; ``force`` reads the bucket now rather than at the next poll."""
        await self.live.refresh(force=force)
        if self.live.cfg is self.cfg:
            return
        previous, self.cfg = self.cfg, self.live.cfg
        await self.recovery.publisher.released()  # across processes a reconfigure is a command to every rank
        self.learner.reconfigure(self.cfg)
        self.checkpoints.keep_last = self.cfg.checkpoint.keep_last
        if self.cfg.alerts != previous.alerts:
            self.alerts.replace_rules(self.cfg.alerts.rules, self.cfg.alerts.cooldown_steps)
        version = self.live.current
        self.journal.emit(
            Event.CONFIG_CHANGE,
            f"config version {version.version} by {version.author}: "
            + ", ".join(f"{c.key}={c.new}" for c in version.changes),
            step=self.progress.step,
            config_version=version.version,
            changes=[vars(c) for c in version.changes],
        )

    async def watch_broker(self) -> None:
        """EXPERIENCE must still hold what this run read: a broker back without its store (or without unsynced
        writes) would otherwise make the reader wait below a lost sequence forever, or skip a gap."""
        created = (await self.bus.check_covers(EXPERIENCE, self.progress.applied_seq)).created

        async def after_reconnect() -> None:
            try:
                await self.bus.check_covers(EXPERIENCE, self.progress.applied_seq, created)
            except BrokerStateLost as error:
                self.broker_lost = error
                self.control.wake()

        self.bus.on_reconnect(after_reconnect)

    async def interrupted(self) -> bool:
        """Between two reads of a batch: a command or a config change drops the partial batch. Meanwhile the
        health rules are judged, so a batch that never completes still raises its alerts."""
        if self.broker_lost is not None:
            raise self.broker_lost
        self.heartbeat.beat()  # waiting for groups is progress: an idle pipeline is not a hung trainer
        if self.control.wakeup.is_set() or await self.live.refresh():
            return True
        await self.check_health()
        return False

    async def check_health(self) -> None:
        """Every few seconds, also while no step comes (a stalled pipeline, a pause): the services_down
        status row and the absent-metric rules, which must not wait for a step to be judged."""
        if time.monotonic() - self.health_checked < HEALTH_CHECK_S:
            return
        self.health_checked = time.monotonic()
        await self.responder.watch({"step": self.progress.step, **await self.health_row()})

    async def health_row(self) -> dict[str, float]:
        """The status row of the alert rules; the replicas a refusing dependency holds go to the run's events."""
        row = await self.status.health_row()
        self.refusals.observe(self.status.services, self.progress.step)
        return row

    async def record_lost(self, group_ids: list[str]) -> None:
        await asyncio.to_thread(self.lineage.record_lost, self.progress.step, group_ids)  # an fsync: off the loop
        count, step = len(group_ids), self.progress.step
        self.journal.emit(
            Event.GROUPS_LOST,
            f"{count} group(s) written off as lost",
            level=logging.ERROR,
            alert=True,
            step=step,
            count=count,
            group_ids=group_ids[:50],
        )
        self.telemetry.record_groups("lost", len(group_ids))  # now: a stalled pipeline brings no step row
        await self.responder.watch({"step": self.progress.step, "groups_lost": float(len(group_ids))})

    async def record_reopened(self, group_id: str, dead_letter: int) -> None:
        step = self.progress.step
        await asyncio.to_thread(self.lineage.record_reopened, step, group_id, dead_letter)  # an fsync: off the loop

    # -- a step ------------------------------------------------------------------------

    async def train_step(self, collected: Collected) -> None:
        progress = self.progress
        publisher = self.recovery.publisher
        with self.step_time.during(StepPhase.PUBLISH):
            await publisher.released()  # the previous version's copy is taken before this step changes the weights
        with self.step_time.during(StepPhase.COMPUTE):
            metrics = await asyncio.to_thread(self.learner.step, collected.batch, progress.version)
        progress.advance(collected.sequence)
        self.ledger.settle_collected(collected, progress.step)
        self.recovery.track_claims(collected.claim_keys)
        await asyncio.to_thread(  # an fsync: off the loop
            self.lineage.record_step,
            progress.step,
            progress.version,
            [(g.group_id, g.policy_version) for g in collected.batch],
            collected.dropped,
            collected.sequence,
            collected.filtered,
        )
        self.samples.record(progress.step, collected.batch)
        with self.step_time.during(StepPhase.PUBLISH):
            self.recovery.offer()  # copied and served in the background; weights that are not finite are refused
        if self.learner.skipped:
            self.skipped_step(self.learner.skipped)
        row = {
            "step": progress.step,
            "policy_version": progress.version,
            "config_version": self.live.version,
            "dropped_stale": len(collected.dropped),
            **dynamic_sampling_row(self.cfg.train, collected),
            **metrics,
            **reward_part_means(collected.batch),
            **episode_metrics(collected.batch, collected.filtered_episodes),
            **self.hardware.row(),  # once per step: each call starts the next step's CUDA peak
            **self.network.row(),
            **self.ledger_rows.row(),
            **await self.health_row(),
            **({"weights/offer_s": publisher.offer_s} if publisher.offer_s is not None else {}),
        }
        # Last: the row's own assembly counts in this step's bookkeeping.
        row.update(step_time_row(self.step_time, self.time_spent))
        progress.reported(row)
        self.telemetry.record_step(row)
        bind_log_fields(step=progress.step)
        if self.presence:
            self.presence.update(policy_version=progress.version, step=progress.step)
        if progress.step % self.cfg.train.log_interval == 0:
            log_event(log, Event.STEP, total_steps=self.cfg.train.total_steps, **row)
        await self.responder.report(row)

    def skipped_step(self, reason: str) -> None:
        """A step that left the weights as they were: non-finite numbers never reach the optimizer, rollouts or the
        store. Its metrics row carries loss NaN, which the nan_loss rule judges. (Weights that are not finite all the
        same are kept from rollouts when they are offered: ``Recovery._weights_refused``.)"""
        step = self.progress.step
        message = f"step {step}: updates skipped, {reason}"
        self.journal.emit(Event.STEP_SKIPPED, message, level=logging.ERROR, alert=True, step=step, reason=reason)

    async def evaluate(self) -> float | None:
        if not self.eval_rows:
            return None
        took = Stopwatch()
        episode_metrics: dict[str, float] = {}
        with self.step_time.during(StepPhase.EVAL):
            await self.recovery.publisher.released()  # across processes an evaluation runs collectives
            if self.cfg.rollout.multi_turn:  # measured as it is trained: episodes with the run's environment
                episodes = await asyncio.to_thread(self.learner.evaluate_episodes, self.eval_rows)
                accuracy, episode_metrics = episodes.accuracy, episodes.metrics()
            else:
                max_new_tokens = self.cfg.sampling.max_new_tokens
                accuracy = await asyncio.to_thread(self.learner.evaluate, self.eval_rows, max_new_tokens)
        self.progress.evaluated(accuracy)
        row = {
            "step": self.progress.step,
            "policy_version": self.progress.version,
            "config_version": self.live.version,
            "eval_accuracy": accuracy,
            **episode_metrics,
            "eval_time_s": took(),
        }
        await self.responder.report(row)
        log_event(log, Event.EVAL, step=self.progress.step, eval_accuracy=accuracy, eval_s=took())
        return accuracy

    async def save(self, wait: bool = False) -> None:
        await self.recovery.save(self.live.version, wait=wait)

    # -- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        progress, control = self.progress, self.control
        self.heartbeat.beat()  # restoring a checkpoint before (prepare) is start-up, not a stalled loop
        self.step_time = TimeShare(StepPhase.BOOKKEEPING)  # the first step's interval starts with the loop
        await self.watch_broker()
        self.intake.rewind()
        await self.intake.catch_up_dead()  # groups dead-lettered while no trainer read DEAD are settled first
        if not self.resumed:
            # The first prompts go out before the baseline evaluation, so the rollouts generate while it runs
            # instead of after it: the evaluation overlaps the wait for the first batch.
            await self.intake.feed(self.cfg.train, self.live.version)
            progress.evaluated(await self.evaluate(), baseline=True)
        while progress.step < self.cfg.train.total_steps and not stop.is_set() and control.state != RunState.STOPPING:
            if self.broker_lost is not None:
                raise self.broker_lost
            self.heartbeat.beat()  # at least every second while paused (wait_while_held below)
            await self.between_steps()
            if not control.running:
                await control.wait_while_held(1.0, on_idle=self.check_health)
                continue
            if self.cfg.train.synchronous:
                # The next prompts ask for the version just trained: it must be served before they go out, or a
                # rollout asking for it may still be told of the one before, generate with that, and have the
                # batch dropped as stale and fed again with other prompts.
                with self.step_time.during(StepPhase.PUBLISH):
                    await self.recovery.publisher.drain()
            with self.step_time.during(StepPhase.WAIT):
                collected = await self.intake.collect(self.cfg.train, self.live.version, self.interrupted, stop)
            if collected is None:
                continue
            if len(collected.batch) < self.cfg.train.batch_size:
                break
            await self.train_step(collected)
            every = self.cfg.checkpoint.save_every_steps
            # The last step is saved by the run's end, once, after the final evaluation: saved here, its copy would
            # stand without it (a stored step is never rewritten in place; checkpoint.py).
            if every and progress.step % every == 0 and progress.step < self.cfg.train.total_steps:
                await self.save()  # and purges after it
            elif not every and progress.step % PURGE_EVERY_STEPS_UNSAVED == 0:
                await self.recovery.purge_consumed()
            eval_every = self.cfg.data.eval_every_steps
            if eval_every and progress.step % eval_every == 0 and progress.step < self.cfg.train.total_steps:
                await self.evaluate()
        await control.run_commands()  # answer whoever asked to stop
        await self.recovery.publisher.drain()  # the last version offered is served (or refused) before the end
        stopped = control.state == RunState.STOPPING
        if not stopped and progress.step < self.cfg.train.total_steps:
            # Stopped by a signal: keep what was applied (a partial batch was not, and will be re-read), with the
            # optimizer state a periodic save of this step may have left out.
            if not progress.saved_in_full:
                await self.save(wait=True)
            log_event(log, Event.STOPPED_EARLY, step=progress.step)
            return
        if not stopped:
            await self.evaluate()  # the run's last word on held-out accuracy, saved with the last step below
        if not progress.saved_in_full or not stopped:
            await self.save(wait=True)  # after any upload still running; the last step once, with its evaluation
        control.state = RunState.DONE
        # Whoever reads "done" (the launcher, then verify and report) finds every row in metrics.jsonl.
        await asyncio.to_thread(self.responder.metrics.flush)
        stopped_by: dict[str, Any] = {"stopped_by": control.stop_reason} if stopped else {}
        self.journal.emit(
            Event.DONE,
            f"stopped ({control.stop_reason}) at step {progress.step}" if stopped else f"{progress.step} steps done",
            step=progress.step,
            steps=progress.step,
            policy_version=progress.version,
            baseline_accuracy=progress.baseline_eval,
            final_accuracy=progress.last_eval,
            **stopped_by,
        )
