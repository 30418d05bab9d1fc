"""What the study records per trial, and what ``rlpipe tune status | best | report`` make of it.

Optuna keeps each trial's number, parameters, state, value and intermediate values; the tuner adds
the rest as user attributes, written through ``TrialRecord`` so every reader sees one schema. A
trial's ``status`` is finer than Optuna's state: ``oom`` is COMPLETE with a violated constraint (so
samplers steer away from it), ``timeout`` and ``failed`` are FAIL, ``pruned`` is PRUNED, and a
``duplicate`` copies the earlier trial it repeats instead of running again.
"""

from __future__ import annotations

import base64
import html
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml

from services.tuner.spec import TuneSpec
from services.tuner.tune_file import base_config_data

FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)


@dataclass
class TrialStart:
    """Written when a trial is claimed: its config, and enough for another tuner to find what it left running."""

    run_id: str
    run_dir: str
    config_path: str  # on ``host``; ``config`` is the same config, readable from any machine
    host: str
    worker_pid: int
    started_at: float
    config: dict[str, Any] = field(default_factory=dict)
    device_slot: str | None = None  # the CUDA_VISIBLE_DEVICES the tuner gave it, if it ran on a device slot
    deadline_s: float = 0.0
    deadline_reason: str = ""
    reserved_device_hours: float = 0.0  # its deadline times its GPUs: held against budget.max_device_hours
    # Set when the launcher started ("launched" attribute): its process group, and CUDA_VISIBLE_DEVICES as
    # the kernel holds the launcher's starting environment.
    pgid: int | None = None
    cuda_visible_devices: str | None = None


@dataclass
class TrialEnd:
    status: str
    reason: str
    steps: int = 0
    objective: float | None = None
    final_metrics: dict[str, float] = field(default_factory=dict)
    peak_rss_gb: float | None = None
    peak_gpu_gb: float | None = None
    wall_s: float = 0.0
    device_hours: float = 0.0
    exit_code: int | None = None
    alerts: list[str] = field(default_factory=list)  # "<rule> (<severity>)"
    constraints: list[float] = field(default_factory=list)  # <= 0 feasible; [0] is out-of-memory
    duplicate_of: int | None = None
    ended_at: float = field(default_factory=time.time)


def save(storage: optuna.storages.BaseStorage, trial_id: int, record: TrialStart | TrialEnd) -> None:
    """Write ``record`` as one user attribute (``start`` or ``end``) of the trial.

    One attribute, so a reader (``rlpipe tune status``, a restarted tuner) never sees half a record.
    """
    storage.set_trial_user_attr(trial_id, "start" if isinstance(record, TrialStart) else "end", asdict(record))


@dataclass
class TrialRecord:
    """One row of ``rlpipe tune status``: a trial as the study holds it."""

    number: int
    state: str
    status: str
    params: dict[str, Any]
    start: TrialStart | None
    end: TrialEnd | None

    @classmethod
    def of(cls, trial: optuna.trial.FrozenTrial) -> TrialRecord:
        attrs = trial.user_attrs
        start = TrialStart(**attrs["start"]) if "start" in attrs else None
        if start is not None and "launched" in attrs:
            # Written on its own the moment the trial's process starts.
            start.pgid = attrs["launched"]["pgid"]
            start.cuda_visible_devices = attrs["launched"]["cuda_visible_devices"]
        end = TrialEnd(**attrs["end"]) if "end" in attrs else None
        if end is None and trial.state == optuna.trial.TrialState.FAIL:
            # Failed by Optuna's stale-heartbeat check, which leaves a finished trial no attribute to write.
            worker = f"{start.host} pid {start.worker_pid}" if start else "unknown"
            end = TrialEnd(
                status="failed",
                reason=f"interrupted: its worker ({worker}) stopped its heartbeat; failed by another worker",
                ended_at=trial.datetime_complete.timestamp() if trial.datetime_complete else 0.0,
            )
        running = trial.state == optuna.trial.TrialState.RUNNING
        status = end.status if end else ("running" if running else trial.state.name.lower())
        return cls(trial.number, trial.state.name, status, dict(trial.params), start, end)

    @property
    def feasible(self) -> bool:
        return self.end is not None and all(c <= 0 for c in self.end.constraints)

    @property
    def objective(self) -> float:
        """The objective a completed trial reached (``ranked`` lists only trials that have one)."""
        if self.end is None or self.end.objective is None:
            raise ValueError(f"trial {self.number} ended without an objective")
        return self.end.objective


def records(study: optuna.Study) -> list[TrialRecord]:
    return [TrialRecord.of(t) for t in study.get_trials(deepcopy=False)]


def ranked(spec: TuneSpec, all_records: list[TrialRecord]) -> list[TrialRecord]:
    """Completed, feasible trials that ran themselves (not duplicates), best first."""
    done = [
        r
        for r in all_records
        if r.status == "complete" and r.feasible and r.end is not None and r.end.objective is not None
    ]
    return sorted(done, key=lambda r: r.objective, reverse=spec.objective.direction == "maximize")


def status_table(spec: TuneSpec, all_records: list[TrialRecord]):
    """A rich Table of every trial."""
    from rich.table import Table

    best = ranked(spec, all_records)
    best_number = best[0].number if best else None
    o = spec.objective
    table = Table(title=f"study {spec.study}: {o.reduce} {o.metric} ({o.direction}); * = best")
    for column in ("#", "status", "objective", "steps", "wall s", "peak GB", "params", "reason / run dir"):
        table.add_column(column, overflow="fold")
    for r in all_records:
        end = r.end
        objective = "" if end is None or end.objective is None else f"{end.objective:.4g}"
        if r.number == best_number:
            objective += " *"
        params = ", ".join(f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in r.params.items())
        where = (end.reason if end and end.reason else "") or (r.start.run_dir if r.start else "")
        table.add_row(
            str(r.number),
            r.status,
            objective,
            str(end.steps) if end else "",
            f"{end.wall_s:.0f}" if end else "",
            f"{end.peak_rss_gb:.2f}" if end and end.peak_rss_gb is not None else "",
            params,
            where,
        )
    return table


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def best_config(spec: TuneSpec, record: TrialRecord, out: Path) -> Path:
    """The base config with the best trial's parameters, as a file ``rlpipe run`` takes unchanged.

    It is the trial's own config with run id ``<study>-best`` (the trial's run directory holds the trial
    and would be refused) and the base's runs dir, so ``train.total_steps`` is what the trial ran and the
    run reproduces what was measured.
    """
    # Exactly what the trial ran (base file, fixed keys, params, the step cap), less what isolated it.
    base = base_config_data(spec)
    # The config as recorded in the study: the trial may have run on another machine.
    data = dict(record.start.config) if record.start else dict(base)
    data["run_id"] = f"{spec.study}-best"
    if "runs_dir" in base:
        data["runs_dir"] = base["runs_dir"]
    else:
        data.pop("runs_dir", None)
    admin = data.get("admin", {})
    if "port" in base.get("admin", {}):
        admin["port"] = base["admin"]["port"]
    else:
        admin.pop("port", None)
    if not admin:
        data.pop("admin", None)
    objective = record.end.objective if record.end else None
    header = (
        f"# best trial {record.number} of study {spec.study}: {spec.objective.reduce} {spec.objective.metric} = "
        f"{objective}\n# base config {spec.base_config}; parameters: {record.params}\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return out


def render_report(spec: TuneSpec, study: optuna.Study, out_dir: Path) -> Path:
    """PNG plots (history, importances, parallel coordinates, intermediate values) and one HTML page."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ov

    # Optuna marks its matplotlib plots experimental; the report is ours to keep working, not the user's to fix.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    out_dir.mkdir(parents=True, exist_ok=True)
    all_records = records(study)
    finished = [t for t in study.get_trials(deepcopy=False) if t.state in FINISHED]
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    plots: dict[str, Path] = {}

    def draw(name: str, plot) -> None:
        try:
            ax = plot()
        except (ValueError, RuntimeError, ZeroDivisionError) as error:
            # Importances need two completed trials with varied params; say so instead of failing the report.
            plots[name] = Path(f"(not drawn: {error})")
            return
        figure = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
        figure.set_size_inches(9, 5)
        figure.tight_layout()
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=90)
        plt.close(figure)
        plots[name] = path

    draw("history", lambda: _history(spec, all_records))
    if len(complete) >= 2:
        draw("importances", lambda: ov.plot_param_importances(study))
        draw("parallel_coordinates", lambda: ov.plot_parallel_coordinate(study))
    draw("intermediate_values", lambda: ov.plot_intermediate_values(study))
    page = out_dir / "report.html"
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(x))}</td>"
            for x in (
                r.number,
                r.status,
                "" if not r.end or r.end.objective is None else f"{r.end.objective:.4g}",
                r.end.steps if r.end else "",
                r.end.wall_s if r.end else "",
                r.params,
                r.end.reason if r.end else "",
            )
        )
        + "</tr>"
        for r in all_records
    )
    images = "".join(
        f"<h2>{name}</h2>"
        + (
            f'<img src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'
            if path.suffix == ".png"
            else f"<p>{html.escape(str(path))}</p>"
        )
        for name, path in plots.items()
    )
    page.write_text(
        f"<!doctype html><meta charset=utf-8><title>study {html.escape(spec.study)}</title>"
        f"<h1>study {html.escape(spec.study)}</h1><table border=1 cellpadding=3>"
        "<tr><th>#<th>status<th>objective<th>steps<th>wall s<th>params<th>reason</tr>"
        f"{rows}</table>{images}"
    )
    return page


def _history(spec: TuneSpec, all_records: list[TrialRecord]):
    """Objective per trial, every status shown (Optuna's own history plot leaves out failed trials)."""
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    colors = {"complete": "tab:blue", "pruned": "tab:orange", "oom": "tab:red", "timeout": "tab:purple"}
    for status in sorted({r.status for r in all_records}):
        group = [r for r in all_records if r.status == status]
        ys = [r.end.objective if r.end and r.end.objective is not None else float("nan") for r in group]
        # Trials without an objective (failed at start) sit on the axis so they are still seen.
        ys = [0.0 if y != y else y for y in ys]
        ax.scatter([r.number for r in group], ys, label=f"{status} ({len(group)})", color=colors.get(status, "gray"))
    best = ranked(spec, all_records)
    if best:
        ax.axhline(best[0].objective, linestyle="--", color="tab:green", label=f"best: trial {best[0].number}")
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{spec.objective.reduce} {spec.objective.metric}")
    ax.set_title(f"study {spec.study}: optimization history")
    ax.legend()
    return ax
