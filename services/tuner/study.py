"""The study loop: claim a trial, run it as an isolated ``rlpipe run``, tell Optuna how it ended.

Failure behaviour:

- A trial that crashes, fails to start, stops on NaN or an alert, runs past its time or memory limit,
  or is pruned is recorded with its status and reason; the loop goes on with the next trial.
- Out of memory is a property of the configuration: the trial is told COMPLETE with a violated
  constraint (``Trial.set_constraint``), so the sampler keeps proposing away from it, and it is never best.
- Parameters identical to an earlier trial's are not run again: the new trial copies the earlier
  one's outcome (status ``duplicate``). A trial interrupted by the tuner's own death may be re-run.
- The tuner itself killed (SIGKILL, a lost machine): its trial's launcher dies with it
  (PR_SET_PDEATHSIG). The next tuner on the same host finds the trial still RUNNING in the study,
  kills whatever is left of its recorded process group, deletes its NATS store and records it
  ``failed`` ("interrupted"). On a database study any worker on any machine also fails it once its
  heartbeat is older than ``parallel.stale_after_s`` (sharing.py). Finished trials are never re-run.
- Several workers and device slots share the study: each claims its next trial under the study's
  claim lock (sharing.py), so the budget holds over all of them. A worker whose trial was failed as
  stale while it still ran (the database out of reach past the grace) stops the trial and leaves the
  record as the other worker wrote it.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import optuna
import yaml
from rich.console import Console

from services.common.config import RunConfig
from services.tuner import records
from services.tuner.budget import StudyBudget
from services.tuner.constraints import constraint_names, constraint_values, feasible
from services.tuner.procs import GpuMemory, group_cmdlines, kill_group
from services.tuner.records import FINISHED, TrialEnd, TrialRecord, TrialStart
from services.tuner.sharing import Heartbeat, beats, claim_lock, open_storage
from services.tuner.spec import AlertConstraint, CategoricalParam, FloatParam, Scalar, TuneSpec
from services.tuner.trial import TrialOutcome, TrialProcess, reduce_values
from services.tuner.tune_file import get_dotted, trial_config_data

__all__ = ["Tuner", "open_storage", "open_study"]

# A sampler that keeps proposing parameters already run has exhausted the space.
MAX_DUPLICATES_IN_A_ROW = 50


def open_study(spec: TuneSpec, storage: optuna.storages.BaseStorage) -> optuna.Study:
    s = spec.sampler
    if s.kind == "tpe":
        sampler: optuna.samplers.BaseSampler = optuna.samplers.TPESampler(
            seed=s.seed, n_startup_trials=s.startup_trials
        )
    else:
        sampler = optuna.samplers.RandomSampler(seed=s.seed)
    p = spec.pruner
    if p.kind == "median":
        pruner: optuna.pruners.BasePruner = optuna.pruners.MedianPruner(
            n_startup_trials=p.startup_trials, n_warmup_steps=p.warmup_steps
        )
    elif p.kind == "successive_halving":
        pruner = optuna.pruners.SuccessiveHalvingPruner(
            min_resource=p.min_resource, reduction_factor=p.reduction_factor
        )
    else:
        pruner = optuna.pruners.NopPruner()
    return optuna.create_study(
        study_name=spec.study,
        storage=storage,
        sampler=sampler,
        pruner=pruner,
        direction=spec.objective.direction,
        load_if_exists=True,
    )


def _alive_tuner(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    # The pid may have been reused by an unrelated process since the tuner died.
    return pid != os.getpid() and b"tune" in cmdline


@dataclass
class Claim:
    """A trial this tuner may run: asked, sampled, not a duplicate, its start recorded."""

    trial: optuna.Trial
    params: dict[str, Scalar]
    start: TrialStart
    config: dict
    heartbeat: Heartbeat


class Tuner:
    """Runs a study to its budget, one trial per device slot at a time; ``run()`` returns why it stopped."""

    def __init__(self, spec: TuneSpec, base: RunConfig, console: Console | None = None, worker: bool = False):
        self.spec = spec
        self.base = base
        self.console = console or Console(stderr=True)
        self.storage = open_storage(spec, on_stale=self.on_stale)
        self.study = open_study(spec, self.storage)
        self.budget = StudyBudget(spec, self.study)
        if worker:
            # Workers seeded alike would all propose the same parameters; Optuna reseeds its parallel jobs so too.
            self.study.sampler.reseed_rng()
        self.host = socket.gethostname()
        self.gpu = GpuMemory()
        self.duplicates_in_a_row = 0
        self.mine: set[int] = set()  # numbers of the trials this process runs now (its device slots)
        # GPUs a trial holds, for device-hours: one (or its slot's) where NVML sees a device and the run may use
        # it; CPU trials count their wall time.
        self.on_gpu = self.gpu.available and bool(self.gpu.device_count) and base.model.device != "cpu"

    def trial_id(self, number: int) -> int:
        """The storage's id of trial ``number``, for attributes written outside the trial's own object."""
        study_id = self.storage.get_study_id_from_name(self.spec.study)
        return self.storage.get_trial_id_from_study_id_trial_number(study_id, number)

    def gpus(self, slot: str | None) -> int:
        if not self.on_gpu:
            return 0
        return len(slot.split(",")) if slot else 1

    # -- recovery -------------------------------------------------------------------------------------

    def recover(self) -> list[int]:
        """Fail the trials dead workers left RUNNING: stale heartbeats anywhere, dead tuners on this host."""
        if beats(self.storage):
            optuna.storages.fail_stale_trials(self.study)  # calls on_stale for each
        recovered = []
        for trial in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if trial.number in self.mine:
                continue
            record = TrialRecord.of(trial)
            start = record.start
            if start is not None and (start.host != self.host or _alive_tuner(start.worker_pid)):
                continue  # another live tuner's trial (another worker, or another machine sharing the study)
            asked_at = trial.datetime_start.timestamp() if trial.datetime_start is not None else time.time()
            if start is None and (beats(self.storage) or time.time() - asked_at < 60):
                # Just asked for by a live tuner, which records its start within moments; on a database study
                # the heartbeat, written right after the ask, tells instead (clocks of other machines may differ).
                continue
            killed = self.kill_leftovers(start)
            end = TrialEnd(
                status="failed",
                reason=f"interrupted: the tuner (pid {start.worker_pid if start else '?'}) died mid-trial; "
                f"{len(killed)} leftover processes killed",
                constraints=feasible(self.spec.objective),
            )
            records.save(self.storage, self.trial_id(trial.number), end)
            self.study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            self.console.log(f"trial {trial.number}: {end.reason}")
            recovered.append(trial.number)
        return recovered

    def on_stale(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        """Optuna failed ``trial``: its worker stopped beating (records.TrialRecord says so when read)."""
        record = TrialRecord.of(trial)
        killed = self.kill_leftovers(record.start)
        why = record.end.reason if record.end is not None else "failed by optuna"  # (TrialRecord.of writes a FAIL's)
        self.console.log(f"trial {trial.number}: {why}; {len(killed)} leftovers killed")

    def kill_leftovers(self, start: TrialStart | None) -> list[str]:
        """What is left on this host of a dead worker's trial: its process group killed, its NATS store deleted."""
        if start is None or start.host != self.host:
            return []  # its machine took them down with the worker (PR_SET_PDEATHSIG), or is gone
        killed: list[str] = []
        if start.pgid is not None:
            # Only a group that is this trial's run: a recycled pgid of an unrelated process is left alone.
            killed = [c for c in group_cmdlines(start.pgid) if start.config_path in c or start.run_dir in c]
            if killed:
                kill_group(start.pgid)
        shutil.rmtree(Path(start.run_dir) / "nats", ignore_errors=True)
        return killed

    # -- budget ----------------------------------------------------------------------------------------

    def stop_reason(self) -> str:
        """Why no further trial may start (empty while one may); called under the claim lock."""
        if why := self.budget.spent():
            return why
        if self.duplicates_in_a_row >= MAX_DUPLICATES_IN_A_ROW:
            return f"the sampler proposed only already-run parameters {MAX_DUPLICATES_IN_A_ROW} times"
        return ""

    # -- the loop --------------------------------------------------------------------------------------

    def run(self) -> str:
        slots: list[str | None] = list(self.spec.parallel.device_slots) or [None]
        if len(slots) == 1:
            why = self.work(slots[0])
        else:
            with ThreadPoolExecutor(len(slots), thread_name_prefix="slot") as pool:
                # Each slot stops for the same budget; the first one's words say it.
                why, *_ = pool.map(self.work, slots)
        self.console.log(f"study {self.spec.study} stopped: {why}")
        return why

    def work(self, slot: str | None) -> str:
        """Claim and run trials on one device slot until the budget says stop; returns why."""
        while isinstance(claim := self.claim(slot), Claim):
            try:
                self.run_trial(claim, slot)
            finally:
                claim.heartbeat.stop()
                self.mine.discard(claim.trial.number)
        return claim

    def claim(self, slot: str | None) -> Claim | str:
        """Under the study's claim lock: the next trial to run on ``slot``, or why none may start."""
        with claim_lock(self.spec, self.storage):
            self.recover()
            self.enqueue_once()
            while not (why := self.stop_reason()):
                trial = self.study.ask()
                self.mine.add(trial.number)
                heartbeat = Heartbeat(self.storage, self.trial_id(trial.number), self.console.log)
                params = self.sample(trial)
                earlier = self.duplicate_of(trial.number, params)
                if earlier is not None:
                    self.copy_outcome(trial, earlier)
                    heartbeat.stop()
                    self.mine.discard(trial.number)
                    continue
                self.duplicates_in_a_row = 0
                start, config = self.record_start(trial, params, slot)
                return Claim(trial, params, start, config, heartbeat)
            return why

    def enqueue_once(self) -> None:
        # A restarted tuner (or a second worker) must not queue the same sets again: the study remembers it did.
        if self.spec.enqueue and not self.study.user_attrs.get("enqueued"):
            for params in self.spec.enqueue:
                self.study.enqueue_trial(params, skip_if_exists=True)
            self.study.set_user_attr("enqueued", True)

    def sample(self, trial: optuna.Trial) -> dict[str, Scalar]:
        """Suggest every parameter of the space whose condition holds, in the order the tune file lists them."""
        params: dict[str, Scalar] = {}
        dumped = self.base.model_dump(mode="json", by_alias=True)
        for key, p in self.spec.space.items():
            if p.when is not None:
                if p.when.param in self.spec.space:
                    if p.when.param not in params or params[p.when.param] not in p.when.values:
                        continue
                elif get_dotted(dumped, p.when.param) not in p.when.values:
                    continue
            if isinstance(p, CategoricalParam):
                choice = trial.suggest_categorical(key, p.choices)
                if choice is None:  # one of p.choices, which holds no None
                    raise ValueError(f"space.{key}: optuna suggested None, which is not one of {p.choices}")
                params[key] = choice
            elif isinstance(p, FloatParam):
                params[key] = trial.suggest_float(key, p.low, p.high, log=p.log, step=p.step)
            else:
                params[key] = trial.suggest_int(key, p.low, p.high, log=p.log, step=p.step)
        return params

    def duplicate_of(self, number: int, params: dict[str, Scalar]) -> optuna.trial.FrozenTrial | None:
        for other in self.study.get_trials(deepcopy=False):
            if other.number == number or other.params != params:
                continue
            record = TrialRecord.of(other)
            if record.end is not None and record.end.reason.startswith("interrupted"):
                continue  # it never had its chance
            if other.state in FINISHED or other.state == optuna.trial.TrialState.RUNNING:
                return other
        return None

    def copy_outcome(self, trial: optuna.Trial, earlier: optuna.trial.FrozenTrial) -> None:
        self.duplicates_in_a_row += 1
        before = TrialRecord.of(earlier)
        end = TrialEnd(
            status="duplicate",
            reason=f"same parameters as trial {earlier.number} ({before.status}); not run again",
            objective=before.end.objective if before.end else None,
            constraints=before.end.constraints if before.end else feasible(self.spec.objective),
            duplicate_of=earlier.number,
        )
        records.save(self.storage, self.trial_id(trial.number), end)
        self.tell_constraints(trial, end.constraints)
        if earlier.state == optuna.trial.TrialState.COMPLETE and earlier.value is not None:
            self.study.tell(trial, earlier.value)
        else:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        self.console.log(f"trial {trial.number}: {end.reason}")

    def record_start(self, trial: optuna.Trial, params: dict[str, Scalar], slot: str | None) -> tuple[TrialStart, dict]:
        """Write the trial's config and its start record, with the share of the budget it may spend."""
        spec = self.spec
        run_id = spec.trial_run_id(trial.number)
        runs_dir = spec.work_dir / "runs"
        config_path = spec.work_dir / "configs" / f"{run_id}.yaml"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        data = trial_config_data(spec, self.base, params, run_id, runs_dir)
        config_path.write_text(
            f"# trial {trial.number} of study {spec.study}: {params}\n" + yaml.safe_dump(data, sort_keys=False)
        )
        gpus = self.gpus(slot)
        deadline_s, deadline_reason = self.budget.deadline(gpus)
        start = TrialStart(
            run_id=run_id,
            run_dir=str(runs_dir / run_id),
            config_path=str(config_path),
            host=self.host,
            worker_pid=os.getpid(),
            started_at=time.time(),
            config=data,
            device_slot=slot,
            deadline_s=deadline_s,
            deadline_reason=deadline_reason,
            reserved_device_hours=max(deadline_s, 0.0) / 3600 * max(gpus, 1),
        )
        records.save(self.storage, self.trial_id(trial.number), start)
        return start, data

    def run_trial(self, claim: Claim, slot: str | None) -> None:
        spec, trial, start = self.spec, claim.trial, claim.start
        run_dir = Path(start.run_dir)
        total_steps = int(claim.config.get("train", {}).get("total_steps", self.base.train.total_steps))
        where = f" on CUDA_VISIBLE_DEVICES={slot}" if slot is not None else ""
        self.console.log(f"trial {trial.number} ({start.run_id}) starts{where}: {claim.params}")
        process = TrialProcess(
            Path(start.config_path),
            run_dir,
            total_steps,
            spec.objective,
            spec.trial,
            start.deadline_s,
            start.deadline_reason,
            self.gpu,
            tracked={c.metric for c in spec.objective.constraints if not isinstance(c, AlertConstraint)},
            visible_devices=slot,
        )
        lost = False

        def on_start(pgid: int, visible_devices: str | None) -> None:
            # Before anything else can happen to the trial: a tuner killed from here on leaves this to find.
            launched = {"pgid": pgid, "cuda_visible_devices": visible_devices}
            self.storage.set_trial_user_attr(self.trial_id(trial.number), "launched", launched)

        def should_prune(step: int, value: float) -> bool:
            nonlocal lost
            try:
                trial.report(value, step)
                return trial.should_prune()
            except optuna.exceptions.UpdateFinishedTrialError:
                lost = True  # failed as stale by another worker: its outcome can no longer be told, stop it
                return True

        outcome = process.run(on_start, should_prune)
        self.clean_up(run_dir, outcome)
        try:
            end = self.record(trial, outcome, self.gpus(slot))
        except optuna.exceptions.UpdateFinishedTrialError:
            lost = True
        if lost:
            self.console.log(
                f"[yellow]trial {trial.number} was failed by another worker while it ran (no heartbeat for "
                f"{spec.parallel.stale_after_s}s: the database out of reach?); its outcome is not recorded"
            )
            return
        self.console.log(
            f"trial {trial.number} {end.status}"
            + (f": objective {end.objective:.4g}" if end.objective is not None else "")
            + (f" ({end.reason})" if end.reason else "")
            + f" after {outcome.wall_s:.0f}s, {outcome.steps} steps"
        )
        self.keep_best_checkpoints()

    def tell_constraints(self, trial: optuna.Trial, values: list[float]) -> None:
        for name, value in zip(constraint_names(self.spec.objective), values, strict=True):
            trial.set_constraint(name, value)

    def record(self, trial: optuna.Trial, outcome: TrialOutcome, gpus: int) -> TrialEnd:
        objective = reduce_values([v for _, v in outcome.values], self.spec.objective)
        end = TrialEnd(
            status=outcome.status,
            reason=outcome.reason,
            steps=outcome.steps,
            objective=objective,
            final_metrics=outcome.final_metrics,
            peak_rss_gb=outcome.peak_rss_gb,
            peak_gpu_gb=outcome.peak_gpu_gb,
            wall_s=outcome.wall_s,
            device_hours=round(outcome.wall_s / 3600 * max(gpus, 1), 6),
            exit_code=outcome.exit_code,
            alerts=[f"{a.rule} ({a.severity})" for a in outcome.alerts],
            constraints=constraint_values(self.spec.objective, outcome),
        )
        records.save(self.storage, self.trial_id(trial.number), end)
        if outcome.status == "complete" and objective is None:
            end.status, end.reason = "failed", f"the run wrote no {self.spec.objective.metric} values"
            records.save(self.storage, self.trial_id(trial.number), end)
        self.tell_constraints(trial, end.constraints)
        if end.status == "complete":
            self.study.tell(trial, objective)
        elif end.status == "oom":
            # COMPLETE with its out-of-memory constraint violated: TPE ranks it below every feasible trial
            # whatever its value, so it needs a finite one; what it reached, or the worst seen so far.
            self.study.tell(trial, objective if objective is not None else self.worst_value())
        elif end.status == "pruned":
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return end

    def worst_value(self) -> float:
        values = [t.value for t in self.study.get_trials(deepcopy=False) if t.value is not None]
        if not values:
            return 0.0
        return min(values) if self.spec.objective.direction == "maximize" else max(values)

    def clean_up(self, run_dir: Path, outcome: TrialOutcome) -> None:
        """The trial's broker store goes (its streams with it); its processes were checked gone by the trial."""
        shutil.rmtree(run_dir / "nats", ignore_errors=True)
        if outcome.leftover_pids:
            self.console.log(f"[yellow]{len(outcome.leftover_pids)} processes outlived the launcher; killed")

    def keep_best_checkpoints(self) -> None:
        """Delete the local checkpoints of every finished trial on this host but the best ``keep_checkpoints``."""
        all_records = records.records(self.study)
        keep = {r.number for r in records.ranked(self.spec, all_records)[: self.spec.keep_checkpoints]}
        for r in all_records:
            if r.number in keep or r.start is None or r.start.host != self.host or r.end is None:
                continue
            for step in self.checkpoint_dir(r.start.run_id).glob("step-*"):
                shutil.rmtree(step, ignore_errors=True)

    def checkpoint_dir(self, run_id: str) -> Path:
        url = self.base.checkpoint.store_url
        if url.startswith("file://"):
            return Path(url.removeprefix("file://")) / run_id
        if url:
            return Path("/nonexistent")  # s3: the bucket's lifecycle rules own it
        return self.spec.work_dir / "runs" / run_id
