"""A seeded simulation of the trainer's intake, ledger, checkpointing, recovery and lease (docs/testing.md).

The components are the real ones: ``Intake`` (with its ``PromptFeeder`` and ``GroupLedger``), ``Recovery``,
``CheckpointStore`` (with its mirror and its fence), ``Lineage`` and ``Lease``. Only what they talk to is small and
in memory (``sim_fakes.py``): the broker, two object stores, the lease bucket, a learner whose weights are a
fingerprint of the steps that made them, the weight server and the clock. A scenario is a list of ``Op``s drawn
from ``random.Random(seed)``; ``run_scenario`` replays one, then drains it (every prompt delivered, time past the
lost bound, steps until nothing is left), and after every op holds the trainer against the world's own record of
what became of every group (``sim_oracle.Oracle``), raising ``InvariantBroken`` naming the op.

A crash can land between any two effects; the trainer's memory is then dropped and the next trainer op starts a
new process, which takes the lease, claims the store's fence and resumes from the store, the lineage file and the
broker, as a new process would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from services.common.config import RunConfig, load_config
from services.common.observe.events import EventLog, Journal
from services.common.observe.instruments import TrainerMetrics
from services.common.transport.breaker import CircuitBreaker
from services.common.transport.bus import Bus
from services.common.transport.streams import DEAD, EXPERIENCE, H_GROUP, H_INCARNATION, BrokerStateLost
from services.trainer import lease as lease_module
from services.trainer.checkpointing import adopter as adopter_module
from services.trainer.checkpointing import checkpointer as checkpointer_module
from services.trainer.checkpointing import recovery as recovery_module
from services.trainer.checkpointing import step_store as step_store_module
from services.trainer.checkpointing.adopter import ResumeRefused
from services.trainer.checkpointing.lineage import ReopenedRecord, RestartRecord, effective_steps, lost_groups
from services.trainer.checkpointing.recovery import Recovery
from services.trainer.checkpointing.state import CheckpointCorrupt
from services.trainer.checkpointing.step_store import FencedOut
from services.trainer.checkpointing.store import AbandonedStep, CheckpointStore
from services.trainer.intake import reader as intake_module
from services.trainer.intake.feeder import PromptFeeder
from services.trainer.intake.ledger import GroupLedger, cursor_position, feed_position
from services.trainer.intake.reader import Intake
from services.trainer.lease import Lease, LeaseLost
from services.trainer.progress import Progress
from tests.trainer.sim_fakes import (
    Clock,
    CountingLineage,
    Effects,
    SimBus,
    SimCrash,
    SimKV,
    SimLearner,
    SimStore,
    SimWeights,
    StoreView,
)
from tests.trainer.sim_oracle import InvariantBroken, Oracle, TrainerView
from tests.trainer.sim_scenario import ALL, SCENARIO_OPS, Features, Op, draw_scenario

DATASET_ROWS = 400  # more than a scenario feeds: ids stay in epoch 0
DATASET = [{"prompt": f"p{i}", "answer": "1"} for i in range(DATASET_ROWS)]
LOST_AFTER_S = 20.0  # train.lost_after_s: a tick can carry a group past it, and past the duplicate window
LEASE_TTL_S = 15.0  # trainer.lease_ttl_s, on the simulated clock
ALIKE_SHARE = 0.25  # with dynamic sampling, how often a rollout's group has all its rewards alike

DRAIN_ROUNDS = 4  # at most: a group written off needs a round to be overtaken, and one to be overdue


# A round of the drain, after the scenario, with crashes and outages over: deliver every prompt, pass the lost
# bound, and read EXPERIENCE out.
DRAIN_ROUND = (Op("deliver"), Op("tick", int(LOST_AFTER_S) + 1), Op("step"), Op("step"), Op("step"))


class LeaseClock:
    """The wall clock a trainer's lease reads. ``frozen``: one reading from before a pause, the lease check the
    process passed just before it was paused, whose write only comes once it wakes."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.frozen: float | None = None

    def __call__(self) -> float:
        if self.frozen is not None:
            now, self.frozen = self.frozen, None
            return now
        return self.clock.wall()


class Trainer:
    """One trainer process: the real components wired as ``services/trainer/{role,service}.py`` wire them."""

    def __init__(self, world: World, holder: str) -> None:
        self.world = world
        self.holder = holder
        self.epoch: int | None = None  # its lease's, once taken
        self.lease: Lease | None = None
        self.clock = LeaseClock(world.clock)
        self.paused_at = 0.0
        self.progress = Progress()
        self.ledger = GroupLedger()
        self.feeder = PromptFeeder(DATASET, 0, shuffle=False)
        self.learner = SimLearner(world.oracle)
        self.lineage = CountingLineage(world.cfg.run_dir / "lineage.jsonl", world.effects)
        mirror = StoreView(world.mirror, world.oracle, self) if world.mirror is not None else None
        self.checkpoints = CheckpointStore(
            StoreView(world.store, world.oracle, self),
            "sim",
            keep_last=world.cfg.checkpoint.keep_last,
            attempts=2,
            backoff_s=0.0,
            mirror=mirror,
        )
        self.intake = Intake(world.bus, self.feeder, self.ledger, self.progress, self._on_lost, self._on_reopened, 100)
        # On the simulated clock, with waits short enough that the real sleeps they cause cost nothing.
        self.intake.broker = CircuitBreaker(cooldown_s=0.002, backoff_s=0.001, clock=world.clock.monotonic)
        self.recovery = Recovery(
            SimpleNamespace(cfg=world.cfg, version=0),
            self.learner,
            self.checkpoints,
            self.lineage,
            self.progress,
            self.ledger,
            self.feeder,
            world.weights,
            world.bus,
            Journal(EventLog(world.cfg.run_dir / "events.jsonl")),
            world.telemetry,
            self._report,
            self.intake.rewind,
        )

    async def take_lease(self, reaped: str) -> None:
        """As ``role.take_lease`` and ``lead_holding``: the lease at an epoch above the store's fence, the fence
        claimed before anything else is written, and the lease checked before every store write."""
        floor = await asyncio.to_thread(self.checkpoints.stored_fence)
        self.lease = Lease(self.world.kv, "sim", LEASE_TTL_S, clock=self.clock, reaped_holder=reaped)
        self.lease.holder = self.holder
        self.epoch = await self.lease.acquire(floor)
        await asyncio.to_thread(self.checkpoints.claim_fence, self.epoch, self.holder)
        self.checkpoints.guard = self.lease.check

    async def release(self) -> None:
        """A clean exit gives the lease up (``role.lead``); a crash leaves it to its TTL or the launcher's takeover."""
        if self.lease is not None:
            await self.lease.release()

    async def _on_lost(self, group_ids: list[str]) -> None:
        self.lineage.record_lost(self.progress.step, group_ids)
        self.world.oracle.written_off(self.progress.incarnation, group_ids)

    async def _on_reopened(self, group_id: str, dead_letter: int) -> None:
        self.lineage.record_reopened(self.progress.step, group_id, dead_letter)

    async def _report(self, row: dict[str, Any]) -> None:
        pass

    async def step(self) -> bool:
        """One pass of the training loop (``Trainer.train_step``): collect (an empty EXPERIENCE interrupts it) and
        apply a full batch; whether a step was applied."""
        cfg = self.world.cfg

        async def interrupted() -> bool:
            return self.intake.reader is not None and self.intake.reader.empty

        if self.intake.reader is not None:
            self.intake.reader.empty = False
        collected = await self.intake.collect(cfg.train, 0, interrupted, asyncio.Event())
        if collected is None or len(collected.batch) < cfg.train.batch_size:
            return False
        progress = self.progress
        self.learner.train(collected, progress.incarnation)
        progress.advance(collected.sequence)
        self.ledger.settle_collected(collected, progress.step)
        self.lineage.record_step(
            progress.step,
            progress.version,
            [(g.group_id, g.policy_version) for g in collected.batch],
            collected.dropped,
            collected.sequence,
            collected.filtered,
        )
        await self.recovery.publish()
        every = cfg.checkpoint.save_every_steps
        if self.world.features.loop and every and progress.step % every == 0:
            await self.recovery.save(0, wait=True)  # the service's upload runs beside the next collect; here, now
        return True


class World:
    """Everything that outlives a trainer process: broker, stores, lease bucket, run folder, weight server, clock,
    and the oracle's record of what happened."""

    def __init__(self, cfg: RunConfig, seed: int, features: Features) -> None:
        train = cfg.train.model_copy(update={"dynamic_sampling": features.dynamic_sampling})
        self.cfg = cfg.model_copy(update={"train": train})
        self.features = features
        self.rng = random.Random(seed)
        self.rewards = random.Random(f"rewards-{seed}")  # a stream of its own: the other draws stay as they were
        self.clock = Clock()
        self.effects = Effects()
        self.oracle = Oracle()
        self.store = SimStore("mem://sim/", self.effects)
        self.mirror = SimStore("mem://mirror/", self.effects) if features.mirror else None
        self.bus = SimBus(self.clock, self.effects, self.oracle)
        self.bus.reads_wait = features.loop
        self.kv = SimKV(self.effects)
        self.weights = SimWeights()
        self.telemetry = TrainerMetrics()
        self.trainer: Trainer | None = None
        self.starting: Trainer | None = None  # the process being started, which a crash may end
        self.zombie: tuple[Trainer, int] | None = None  # a paused trainer, and what it does when it wakes
        self.processes = 0
        self.reaped = ""  # the lease holder of the last process seen dead: its restart takes the lease at once
        self.started = False  # a first start (fresh) was made: later starts resume
        self.broker_lost = False  # the broker lost EXPERIENCE messages: a trainer that read them must stop
        self.halted = ""  # why the trainer stopped for an operator (exit 2): nothing starts it again
        self.steps_taken = 0
        self.outcomes: Counter[str] = Counter()

    # -- processes ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start a trainer process (``rlpipe run`` or its launcher, resuming after the first start)."""
        if self.halted:
            return
        self.processes += 1
        trainer = self.starting = Trainer(self, f"trainer-{self.processes}")
        self.bus.experience_reader = None
        try:
            if self.features.lease:
                await trainer.take_lease(self.reaped)
            adopted = await trainer.recovery.start(resume=self.started)
            # The loop's first look at EXPERIENCE (``watch_broker``): it must still hold what the trainer read.
            await Bus.check_covers(self.bus, EXPERIENCE, trainer.progress.applied_seq)  # type: ignore[arg-type]
        except BrokerStateLost as error:
            await trainer.release()
            self.halt(error)
            return
        except (ResumeRefused, OSError):
            await trainer.release()
            self.outcomes["start refused"] += 1
            return  # the process ended; the next trainer op starts it again, as an operator (or the launcher) would
        finally:
            self.starting = None
        if adopted:
            self.oracle.resumed(trainer.progress.incarnation, trainer.learner.copied_at)
        self.started = True
        self.trainer = trainer

    def crashed(self) -> None:
        """The process running died: its launcher reaped it, so its restart takes its lease at once."""
        process = self.starting or self.trainer
        if process is not None:
            self.reaped = process.holder
        self.trainer = self.starting = None
        self.outcomes["crashed mid-effect"] += 1

    def halt(self, error: BrokerStateLost) -> None:
        """The trainer found the broker missing what it read and exits for an operator, as it must: unless the
        world lost messages, that is a gap it made itself (reading on from a sequence its own purge removed)."""
        if not self.broker_lost:
            self.oracle.violations.append(f"the trainer met lost EXPERIENCE messages the broker never lost: {error}")
        self.halted = str(error)
        self.trainer = None
        self.outcomes["broker state lost"] += 1

    async def renew(self) -> None:
        """The live trainer's lease keeper (``Lease.keep``): it renews once a third of the TTL has passed."""
        trainer = self.trainer
        if trainer is None or trainer.lease is None or trainer.lease.record is None:
            return
        if trainer.lease.record.expires_at - self.clock.wall() > LEASE_TTL_S * 2 / 3:
            return
        try:
            await trainer.lease.renew()
        except LeaseLost:
            self.reaped, self.trainer = trainer.holder, None
            self.outcomes["lease lost"] += 1

    async def pass_time(self, seconds: float) -> None:
        """Time passes; the live trainer renews its lease meanwhile, every third of its TTL."""
        while seconds > 0:
            spent = min(seconds, LEASE_TTL_S / 3)
            self.clock.now += spent
            seconds -= spent
            await self.renew()

    async def wake_zombie(self) -> None:
        """The paused trainer wakes after a successor claimed the fence and makes the write it had checked its lease
        for: a save of its state, or a STABLE mark. The fence must refuse it."""
        zombie, action = self.zombie
        self.zombie = None
        zombie.clock.frozen = zombie.paused_at
        self.outcomes["zombie woke"] += 1
        try:
            if action % 2:
                steps = await asyncio.to_thread(zombie.checkpoints.steps)
                if steps:
                    await zombie.recovery.mark_stable(steps[action % len(steps)])
            else:
                await zombie.recovery.save(0, wait=True)
        except FencedOut:
            self.outcomes["zombie fenced out"] += 1
        except (LeaseLost, OSError, KeyError, AbandonedStep, SimCrash):
            pass  # its lease ran out by its own clock, the store failed, or it died: no write either way

    def alike(self) -> bool:
        """Whether a rollout's group has all its rewards alike (which dynamic sampling filters out)."""
        return self.features.dynamic_sampling and self.rewards.random() < ALIKE_SHARE

    def served_version(self) -> int:
        return self.weights.served[-1] if self.weights.served else 0

    def pending(self, trainer: Trainer) -> set[str]:
        """The live trainer's groups the world still holds: prompts on PROMPTS, and EXPERIENCE it has not read."""
        inc = trainer.progress.incarnation
        reader = self.bus.experience_reader
        start = reader.next_seq if reader is not None else trainer.progress.applied_seq + 1
        prompts = {fed.group_id for fed in self.bus.prompts if fed.incarnation == inc}
        unread = {
            (m.headers or {}).get(H_GROUP)
            for seq, m in self.bus.streams[EXPERIENCE].messages.items()
            if seq >= start and (m.headers or {}).get(H_INCARNATION) == inc
        }
        return prompts | unread

    # -- ops --------------------------------------------------------------------------------

    async def act(self, op: Op) -> None:
        """Apply ``op`` as the world does: a crash ends the process it reaches."""
        try:
            if self.zombie is not None and self.trainer is not None and self.oracle.fence > self.zombie[0].epoch:
                await self.wake_zombie()
            await self.renew()
            await self.apply(op)
        except SimCrash:
            self.crashed()

    async def apply(self, op: Op) -> None:
        trainer, bus, rng, alike = self.trainer, self.bus, self.rng, self.alike
        if op.kind == "generate" and bus.prompts:
            fed = bus.prompts.pop(rng.randrange(len(bus.prompts)))
            bus.taken.append(fed)
            # A rollout may lag a few versions behind the trainer.
            bus.experience(fed, max(0, self.served_version() - rng.randint(0, 3)), alike=alike())
        elif op.kind == "recompute" and bus.taken:
            fed = rng.choice(bus.taken)
            # Inside the duplicate window the broker drops the copy; past it the trainer must refuse it itself.
            bus.experience(fed, max(0, self.served_version() - rng.randint(0, 12)), alike=alike())
        elif op.kind == "deliver":  # every prompt waiting, at the version served
            while bus.prompts:
                fed = bus.prompts.pop(0)
                bus.taken.append(fed)
                bus.experience(fed, self.served_version(), alike=alike())
        elif op.kind == "poison" and bus.prompts:
            bus.experience(bus.prompts.pop(rng.randrange(len(bus.prompts))), 0, poisoned=True)
        elif op.kind == "drop" and bus.prompts:
            bus.prompts.pop(rng.randrange(len(bus.prompts)))
        elif op.kind == "tick":
            await self.pass_time(op.arg)
        elif op.kind == "store_down":
            self.store.fail_next = op.arg
        elif op.kind == "mirror_down" and self.mirror is not None:
            self.mirror.fail_next = op.arg
        elif op.kind == "bitrot":
            self.rot(op.arg)
        elif op.kind == "broker_down":
            bus.fail_next = op.arg
        elif op.kind == "broker_loss":
            lost = bus.restart_losing(op.arg)
            self.broker_lost = self.broker_lost or bool(lost)
            self.outcomes["experience lost by the broker"] += len(lost)
        elif op.kind == "crash":
            if op.arg % 3 == 0:
                if trainer is not None:
                    self.reaped, self.trainer = trainer.holder, None  # dies now
            else:
                self.effects.crash_after = op.arg  # dies at that effect, wherever it falls
        elif op.kind == "zombie":
            if trainer is not None and trainer.lease is not None and self.zombie is None:
                # Paused (SIGSTOP, a long pause) right after its lease check: nobody reaps it, its lease runs out.
                trainer.paused_at = self.clock.wall()
                self.zombie, self.trainer = (trainer, op.arg), None
        elif op.kind == "reinject":  # an operator's command: it needs no trainer running
            letters = sorted(bus.streams[DEAD].messages)
            if letters and bus.reinject(letters[op.arg % len(letters)], self.served_version()):
                self.outcomes["reinjected"] += 1
        elif trainer is None:
            await self.start()  # every trainer op finds it down: the launcher restarted it
        elif op.kind == "step":
            try:
                self.steps_taken += await trainer.step()
            except BrokerStateLost as error:
                await trainer.release()
                self.halt(error)
        elif op.kind == "save":
            await trainer.recovery.save(0, wait=True)
        elif op.kind == "purge":
            await trainer.recovery.purge_consumed()
        elif op.kind in ("mark_stable", "rollback"):
            # Operator commands: a refusal or a store outage answers the operator and changes nothing.
            with contextlib.suppress(LookupError, CheckpointCorrupt, OSError):
                steps = await asyncio.to_thread(trainer.checkpoints.steps)
                if not steps:
                    return
                step = steps[op.arg % len(steps)]
                if op.kind == "mark_stable":
                    await trainer.recovery.mark_stable(step)
                else:
                    await trainer.recovery.rollback(step, "simulated rollback")

    def rot(self, arg: int) -> None:
        """One stored object of a step changes under the store (bitrot): its copy no longer matches its manifest."""
        store = self.mirror if arg % 2 and self.mirror is not None else self.store
        keys = [k for k in sorted(store.objects) if "/step-" in k and not k.endswith(("STABLE", "ABANDONED"))]
        if keys:
            key = keys[arg % len(keys)]
            data = store.objects[key]
            store.objects[key] = data[:-1] + bytes([data[-1] ^ 0x5A]) if data else b"?"
            self.outcomes["objects rotted"] += 1

    def calm(self) -> None:
        """The drain's weather: no crash armed, no outage."""
        self.effects.crash_after = None
        self.store.fail_next = self.bus.fail_next = 0
        if self.mirror is not None:
            self.mirror.fail_next = 0

    # -- invariants ---------------------------------------------------------------------------

    def check(self, where: str) -> None:
        try:
            self.oracle.check_served(self.weights.served)
            trainer = self.trainer
            if trainer is not None:
                self.oracle.check_trainer(
                    TrainerView(
                        incarnation=trainer.progress.incarnation,
                        fingerprint=trainer.learner.fingerprint,
                        records=trainer.lineage.records(),
                        ledger=trainer.ledger,
                        cursor=cursor_position(trainer.feeder.cursor),
                        pending=self.pending(trainer),
                    )
                )
        except InvariantBroken as broken:
            raise InvariantBroken(f"{where}: {broken}") from None

    def drained(self) -> bool:
        """Whether every group the live trainer fed has a fate or still waits on PROMPTS or in EXPERIENCE."""
        trainer = self.trainer
        if trainer is None:
            return self.halted != ""
        fingerprint, inc = trainer.learner.fingerprint, trainer.progress.incarnation
        return not self.oracle.fateless(inc, fingerprint, self.pending(trainer))

    def check_final(self, stalled: bool) -> None:
        """After the drain. ``stalled``: its last round applied no step though every prompt was delivered: every
        slot is held by a group the world lost (or a stale one that cannot fill a batch), nothing is fed, so nothing
        overtakes the lost ones, which by design wait for the stall alerts (``GroupLedger.overdue``); nor is
        anything fed again that a resume went back before."""
        trainer = self.trainer
        if trainer is None:
            self.outcomes["ended without a trainer"] += 1
            return
        waiting: set[str] = set()
        if stalled:
            self.outcomes["ended stalled on lost groups"] += 1
            cursor = cursor_position(trainer.feeder.cursor)
            unfed = {g for g in self.oracle.fed[trainer.progress.incarnation] if (feed_position(g) or cursor) >= cursor}
            waiting = set(trainer.ledger.in_flight) | unfed
        try:
            self.oracle.check_final(
                trainer.progress.incarnation, trainer.learner.fingerprint, self.pending(trainer), waiting
            )
        except InvariantBroken as broken:
            raise InvariantBroken(f"after the drain: {broken}") from None


def sim_config(root: Path) -> RunConfig:
    """The run config of every scenario: small batches, a short lost bound, resumes that never wait."""
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")  # the config checks the folder; the simulated learner reads nothing
    rows = root / "train.jsonl"
    rows.write_text('{"prompt": "p", "answer": "1"}\n')
    return load_config(
        run_id="sim",
        runs_dir=str(root / "runs"),
        model={"path": str(model)},
        data={"train_path": str(rows), "eval_path": str(rows), "eval_every_steps": 0},
        train={
            "batch_size": 2,
            "max_inflight_batches": 2,
            "max_staleness": 4,
            "lost_after_s": LOST_AFTER_S,
        },
        checkpoint={"save_every_steps": 2, "keep_last": 2, "resume_wait_s": 0},
        nats={"ack_wait_s": 5, "heartbeat_s": 1, "max_deliver": 1},
    )


class _NoYaml:
    """The effective config a checkpoint carries for operators, not read back: dumping the whole config as YAML at
    every save would cost more than the rest of a scenario."""

    @staticmethod
    def safe_dump(data: Any, sort_keys: bool = False) -> str:
        return ""


class _Build:
    """The build a checkpoint names, without asking git for it at every simulated process start."""

    def resolved(self) -> SimpleNamespace:
        return SimpleNamespace(version="sim", revision="sim")


@contextlib.contextmanager
def simulated_world(clock: Clock):
    """The intake, adopter and lease read ``clock`` (the lease's waits pass simulated time); the operators' extras
    in a checkpoint are left out (see ``_NoYaml``, ``_Build``); ``os.fsync`` does nothing: a simulated crash ends
    the process, never the machine, so the page cache survives it and every fsync would be pure cost (on a busy
    disk, most of a scenario's), and neither does the store's retry sleep (its backoff is 0 here). Everything else
    is as in production."""

    async def sleep(seconds: float) -> None:
        clock.now += seconds
        await asyncio.sleep(0)

    fake_time = SimpleNamespace(monotonic=clock.monotonic)
    stand_ins = [
        (intake_module, "time", fake_time),
        (adopter_module, "time", fake_time),
        (lease_module, "asyncio", SimpleNamespace(sleep=sleep)),
        (checkpointer_module, "yaml", _NoYaml),
        (recovery_module, "BuildInfo", _Build),
        (os, "fsync", lambda fd: None),
        (step_store_module, "time", SimpleNamespace(sleep=lambda seconds: None, time=time.time)),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in stand_ins]
    for owner, name, stand_in in stand_ins:
        setattr(owner, name, stand_in)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@contextlib.contextmanager
def quiet():
    """The components' logs (thousands of outages and crashes a run) would drown the one line that matters."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


class InlineExecutor(ThreadPoolExecutor):
    """Runs what the components hand to ``asyncio.to_thread`` at once, on the loop's thread: a scenario is one thread,
    so it replays the same way every time (and a thread hop per store call would cost most of its time). A
    ThreadPoolExecutor only because asyncio takes no other kind as the default; it never starts a thread."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # SimCrash too: it ends the process at the awaiting caller
            future.set_exception(error)
        return future


async def _run(cfg: RunConfig, seed: int, ops: list[Op], features: Features) -> Counter[str]:
    asyncio.get_running_loop().set_default_executor(InlineExecutor())
    world = World(cfg, seed, features)
    with simulated_world(world.clock), quiet():
        await world.start()
        for index, op in enumerate(ops):
            await world.act(op)
            world.check(f"after op {index} {op}")
        world.calm()
        for round_ in range(DRAIN_ROUNDS):  # until every fed group has a fate or waits in the world
            steps_before = world.steps_taken
            for op in DRAIN_ROUND:
                await world.act(op)
                world.check(f"after drain round {round_} {op}")
            if world.drained():
                break
        world.check_final(stalled=not world.drained() and world.steps_taken == steps_before)
        if world.trainer is not None:
            records = world.trainer.lineage.records()
            applied = {group for record in effective_steps(records) for group, _ in record.groups}
            if named := sorted(applied & set(lost_groups(records))):
                raise InvariantBroken(f"the lineage names groups the current model applied as lost: {named}")
            world.outcomes["steps applied"] += len(effective_steps(records))
            world.outcomes["groups lost"] += len(lost_groups(records))
            world.outcomes["groups filtered"] += sum(len(record.filtered) for record in effective_steps(records))
            world.outcomes["groups reopened"] += sum(1 for record in records if isinstance(record, ReopenedRecord))
            for record in records:
                world.outcomes[record.event if isinstance(record, RestartRecord) else ""] += 1
        world.outcomes["dead letters"] += len(world.bus.streams[DEAD].messages)
        world.outcomes["checkpoints read from the mirror"] += world.mirror.weights_read if world.mirror else 0
        return world.outcomes


def run_scenario(cfg: RunConfig, seed: int, length: int = SCENARIO_OPS, features: Features = ALL) -> Counter[str]:
    """Replay scenario ``seed`` in a clean run folder; returns what happened in it (a ``Counter`` of outcomes:
    steps applied, resumes, crashes mid-effect...), for the coverage checks."""
    return run_ops(cfg, seed, draw_scenario(seed, length, features), features)


def run_ops(cfg: RunConfig, seed: int, ops: list[Op], features: Features = ALL) -> Counter[str]:
    """Run ``ops`` (a scenario drawn, or one written out), the world's own choices drawn from ``seed``."""
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    return asyncio.run(_run(cfg, seed, ops, features))
