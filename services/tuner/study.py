"""The study loop: ask Optuna for parameters, run them as an isolated trial, tell it how the trial ended.

Failure behaviour:

- A trial that crashes, fails to start, stops on NaN or an alert, runs past its time or memory limit,
  or is pruned is recorded with its status and reason; the loop goes on with the next trial.
- Out of memory is a property of the configuration: the trial is told COMPLETE with a violated
  constraint (``Trial.set_constraint``), so the sampler keeps proposing away from it, and it is never best.
- Parameters identical to an earlier trial's are not run again: the new trial copies the earlier
  one's outcome (status ``duplicate``). A trial interrupted by the tuner's own death may be re-run.
- The tuner itself killed (SIGKILL, a lost machine): its trial's launcher dies with it
  (PR_SET_PDEATHSIG), and the next tuner on the same host finds the trial still RUNNING in the study,
  kills whatever is left of its recorded process group, deletes its NATS store and records it
  ``failed`` ("interrupted"). Finished trials are in the study's storage and are never re-run.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
import yaml
from rich.console import Console

from services.common.config import RunConfig
from services.tuner import records
from services.tuner.procs import GpuMemory, group_cmdlines, kill_group
from services.tuner.records import FINISHED, TrialEnd, TrialRecord, TrialStart
from services.tuner.spec import AlertConstraint, CategoricalParam, FloatParam, TuneSpec, get_dotted, trial_config_data
from services.tuner.trial import TrialOutcome, TrialProcess, reduce_values

SEVERITY = {"info": 0, "warning": 1, "critical": 2}
# A sampler that keeps proposing parameters already run has exhausted the space.
MAX_DUPLICATES_IN_A_ROW = 50


def open_storage(spec: TuneSpec) -> optuna.storages.BaseStorage:
    url = spec.storage_url
    if url.startswith("journal:"):
        path = Path(url.removeprefix("journal:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        backend = optuna.storages.journal.JournalFileBackend(str(path))
        return optuna.storages.JournalStorage(backend)
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.RDBStorage(url)


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
class Budget:
    trials_counted: int
    reason: str  # why no further trial starts; empty while one may


class Tuner:
    """Runs a study to its budget; ``run()`` returns why it stopped."""

    def __init__(self, spec: TuneSpec, base: RunConfig, console: Console | None = None):
        self.spec = spec
        self.base = base
        self.console = console or Console(stderr=True)
        self.storage = open_storage(spec)
        self.study = open_study(spec, self.storage)
        self.host = socket.gethostname()
        self.gpu = GpuMemory()
        self.started = time.monotonic()
        self.duplicates_in_a_row = 0
        # GPUs a trial holds, for device-hours: one where NVML sees a device and the run may use it; CPU trials
        # count their wall time.
        self.gpus_per_trial = 1 if self.gpu.available and self.gpu.device_count and base.model.device != "cpu" else 0

    def trial_id(self, number: int) -> int:
        """The storage's id of trial ``number``, for attributes written outside the trial's own object."""
        study_id = self.storage.get_study_id_from_name(self.spec.study)
        return self.storage.get_trial_id_from_study_id_trial_number(study_id, number)

    # -- recovery -------------------------------------------------------------------------------------

    def recover(self) -> list[int]:
        """Record as failed the trials a dead tuner on this host left RUNNING; kill what is left of them."""
        recovered = []
        for trial in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            record = TrialRecord.of(trial)
            start = record.start
            if start is not None and (start.host != self.host or _alive_tuner(start.worker_pid)):
                continue  # another live tuner's trial (another worker, or another machine sharing the study)
            if start is None and time.time() - trial.datetime_start.timestamp() < 60:
                continue  # just asked for by a live tuner, which records its start within moments
            killed: list[str] = []
            if start is not None and start.pgid is not None:
                # Only a group that is this trial's run: a recycled pgid of an unrelated process is left alone.
                mine = [c for c in group_cmdlines(start.pgid) if start.config_path in c or start.run_dir in c]
                if mine:
                    killed = mine
                    kill_group(start.pgid)
            if start is not None:
                shutil.rmtree(Path(start.run_dir) / "nats", ignore_errors=True)
            end = TrialEnd(
                status="failed",
                reason=f"interrupted: the tuner (pid {start.worker_pid if start else '?'}) died mid-trial; "
                f"{len(killed)} leftover processes killed",
                constraints=self.feasible_constraints(),
            )
            records.save(self.storage, self.trial_id(trial.number), end)
            self.study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            self.console.log(f"trial {trial.number}: {end.reason}")
            recovered.append(trial.number)
        return recovered

    # -- budget ----------------------------------------------------------------------------------------

    def budget(self) -> Budget:
        trials = self.study.get_trials(deepcopy=False)
        ended = [TrialRecord.of(t) for t in trials if t.state in FINISHED]
        counted = sum(1 for r in ended if r.status != "duplicate")
        running = sum(1 for t in trials if t.state == optuna.trial.TrialState.RUNNING)
        b = self.spec.budget
        if counted + running >= b.max_trials:
            return Budget(counted, f"budget.max_trials ({b.max_trials}) reached")
        if b.max_wall_s is not None and time.monotonic() - self.started >= b.max_wall_s:
            return Budget(counted, f"budget.max_wall_s ({b.max_wall_s:g}s) reached")
        if b.max_device_hours is not None and self.device_hours(ended) >= b.max_device_hours:
            return Budget(counted, f"budget.max_device_hours ({b.max_device_hours:g}) reached")
        if self.duplicates_in_a_row >= MAX_DUPLICATES_IN_A_ROW:
            return Budget(counted, f"the sampler proposed only already-run parameters {MAX_DUPLICATES_IN_A_ROW} times")
        return Budget(counted, "")

    @staticmethod
    def device_hours(ended: list[TrialRecord]) -> float:
        return sum(r.end.device_hours for r in ended if r.end is not None)

    def deadline(self) -> tuple[float, str]:
        """Wall seconds the next trial may run, and which limit that is."""
        options = [(self.spec.trial.max_wall_s, "trial.max_wall_s")]
        b = self.spec.budget
        if b.max_wall_s is not None:
            options.append((b.max_wall_s - (time.monotonic() - self.started), "budget.max_wall_s"))
        if b.max_device_hours is not None:
            ended = [TrialRecord.of(t) for t in self.study.get_trials(deepcopy=False) if t.state in FINISHED]
            left_h = b.max_device_hours - self.device_hours(ended)
            options.append((left_h * 3600 / max(self.gpus_per_trial, 1), "budget.max_device_hours"))
        return min(options)

    # -- the loop --------------------------------------------------------------------------------------

    def run(self) -> str:
        self.recover()
        self.enqueue_once()
        while not (why := self.budget().reason):
            trial = self.study.ask()
            params = self.sample(trial)
            earlier = self.duplicate_of(trial.number, params)
            if earlier is not None:
                self.copy_outcome(trial, earlier)
                continue
            self.duplicates_in_a_row = 0
            self.run_trial(trial, params)
        self.console.log(f"study {self.spec.study} stopped: {why}")
        return why

    def enqueue_once(self) -> None:
        # A restarted tuner must not queue the same sets again: the study remembers it did.
        if self.spec.enqueue and not self.study.user_attrs.get("enqueued"):
            for params in self.spec.enqueue:
                self.study.enqueue_trial(params, skip_if_exists=True)
            self.study.set_user_attr("enqueued", True)

    def sample(self, trial: optuna.Trial) -> dict[str, object]:
        """Suggest every parameter of the space whose condition holds, in the order the tune file lists them."""
        params: dict[str, object] = {}
        dumped = self.base.model_dump(mode="json", by_alias=True)
        for key, p in self.spec.space.items():
            if p.when is not None:
                if p.when.param in self.spec.space:
                    if p.when.param not in params or params[p.when.param] not in p.when.values:
                        continue
                elif get_dotted(dumped, p.when.param) not in p.when.values:
                    continue
            if isinstance(p, CategoricalParam):
                params[key] = trial.suggest_categorical(key, p.choices)
            elif isinstance(p, FloatParam):
                params[key] = trial.suggest_float(key, p.low, p.high, log=p.log, step=p.step)
            else:
                params[key] = trial.suggest_int(key, p.low, p.high, log=p.log, step=p.step)
        return params

    def duplicate_of(self, number: int, params: dict[str, object]) -> optuna.trial.FrozenTrial | None:
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
            constraints=before.end.constraints if before.end else self.feasible_constraints(),
            duplicate_of=earlier.number,
        )
        records.save(self.storage, self.trial_id(trial.number), end)
        self.tell_constraints(trial, end.constraints)
        if earlier.state == optuna.trial.TrialState.COMPLETE and earlier.value is not None:
            self.study.tell(trial, earlier.value)
        else:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        self.console.log(f"trial {trial.number}: {end.reason}")

    def run_trial(self, trial: optuna.Trial, params: dict[str, object]) -> None:
        spec = self.spec
        run_id = spec.trial_run_id(trial.number)
        runs_dir = spec.work_dir / "runs"
        run_dir = runs_dir / run_id
        config_path = spec.work_dir / "configs" / f"{run_id}.yaml"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        data = trial_config_data(spec, self.base, params, run_id, runs_dir)
        config_path.write_text(
            f"# trial {trial.number} of study {spec.study}: {params}\n" + yaml.safe_dump(data, sort_keys=False)
        )
        start = TrialStart(
            run_id=run_id,
            run_dir=str(run_dir),
            config_path=str(config_path),
            host=self.host,
            worker_pid=os.getpid(),
            started_at=time.time(),
        )
        records.save(self.storage, self.trial_id(trial.number), start)
        deadline_s, deadline_reason = self.deadline()
        total_steps = int(data.get("train", {}).get("total_steps", self.base.train.total_steps))
        self.console.log(f"trial {trial.number} ({run_id}) starts: {params}")
        process = TrialProcess(
            config_path,
            run_dir,
            total_steps,
            spec.objective,
            spec.trial,
            deadline_s,
            deadline_reason,
            self.gpu,
            tracked={c.metric for c in spec.objective.constraints if not isinstance(c, AlertConstraint)},
        )

        def on_start(pgid: int) -> None:
            # Before anything else can happen to the trial: a tuner killed from here on leaves this to find.
            self.storage.set_trial_user_attr(self.trial_id(trial.number), "pgid", pgid)

        def should_prune(step: int, value: float) -> bool:
            trial.report(value, step)
            return trial.should_prune()

        outcome = process.run(on_start, should_prune)
        end = self.record(trial, outcome)
        self.clean_up(run_dir, outcome)
        self.console.log(
            f"trial {trial.number} {end.status}"
            + (f": objective {end.objective:.4g}" if end.objective is not None else "")
            + (f" ({end.reason})" if end.reason else "")
            + f" after {outcome.wall_s:.0f}s, {outcome.steps} steps"
        )
        self.keep_best_checkpoints()

    def constraint_names(self) -> list[str]:
        names = ["oom"]
        for i, c in enumerate(self.spec.objective.constraints):
            names.append(f"{i}:no_alert_{c.no_alert}" if isinstance(c, AlertConstraint) else f"{i}:{c.metric}")
        return names

    def tell_constraints(self, trial: optuna.Trial, values: list[float]) -> None:
        # TPE puts every trial with a positive constraint below every feasible one, whatever its value.
        for name, value in zip(self.constraint_names(), values, strict=True):
            trial.set_constraint(name, value)

    def feasible_constraints(self) -> list[float]:
        return [0.0] * (1 + len(self.spec.objective.constraints))

    def constraint_values(self, outcome: TrialOutcome) -> list[float]:
        """<= 0 where a rule holds; [0] is out of memory, then the tune file's constraints in order."""
        values = [1.0 if outcome.status == "oom" else 0.0]
        for c in self.spec.objective.constraints:
            if isinstance(c, AlertConstraint):
                worst = SEVERITY[c.no_alert]
                values.append(float(sum(1 for a in outcome.alerts if SEVERITY.get(a.severity, 0) >= worst)))
                continue
            series = outcome.series.get(c.metric, [])
            if not series:
                values.append(1.0)  # never measured: cannot be shown to hold
                continue
            reduced = {
                "final": series[-1],
                "max": max(series),
                "min": min(series),
                "mean": sum(series) / len(series),
            }[c.reduce]
            values.append(reduced - c.below if c.below is not None else c.above - reduced)
        return values

    def record(self, trial: optuna.Trial, outcome: TrialOutcome) -> TrialEnd:
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
            device_hours=round(outcome.wall_s / 3600 * max(self.gpus_per_trial, 1), 6),
            exit_code=outcome.exit_code,
            alerts=[f"{a.rule} ({a.severity})" for a in outcome.alerts],
            constraints=self.constraint_values(outcome),
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
