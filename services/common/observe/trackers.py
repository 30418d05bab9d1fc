"""Experiment trackers: TensorBoard, MLflow and Weights & Biases, fed from the trainer's metrics rows.

``telemetry.report_to`` names the trackers. The trainer's metrics log hands every row it writes
(step rows, evaluations, checkpoints, alerts) to ``TrackerFanout.write``, which turns it into
tracker metrics under the common namespaces (``actor/pg_loss``, ``critic/vf_loss``,
``reward/mean``, ``response_length/mean``: each metric's ``tracker_name`` in the metrics contract,
services/common/observe/metrics.py, listed in docs/metrics.md) and into text events for alerts,
checkpoints and config versions.

One tracker run per rlpipe run, named by the run id; a resumed trainer appends to it:
TensorBoard writes new event files into the same ``<run dir>/tensorboard``, MLflow finds its run by
the ``rlpipe.run_id`` tag, W&B resumes the run whose id is the run id (offline unless
``telemetry.wandb_mode: online``).

Each backend's library is imported only when it is named, with an error naming the ``trackers``
extra when it is missing. A tracker that fails mid-run is logged and skipped for that row: the
metrics file has every row, and training does not wait on a dashboard.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from services.common.config import RunConfig, TelemetryConfig, redacted_dump
from services.common.observe import metrics as m
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.observe.records import MetricsRow

log = logging.getLogger(__name__)

EXTRA = "trackers"  # pip install 'rlpipe[trackers]'


class TrackerUnavailable(RuntimeError):
    """A tracker named in telemetry.report_to whose library is not installed."""


@dataclass
class TrackerEntry:
    """What one metrics row becomes in a tracker: numbers at a step, and text events (alert, checkpoint, config)."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    events: dict[str, str] = field(default_factory=dict)  # kind -> text


def tracker_entry(row: MetricsRow, last_config_version: int | None) -> TrackerEntry:
    """Map one metrics row (pure): numbers renamed by ``tracker_name``, alerts, checkpoints and new config versions
    as events; ``last_config_version`` is the version the previous row carried (None before the first)."""
    entry = TrackerEntry(step=row.step or 0)
    for key, value in row.numbers():
        if key not in m.NOT_METRICS:
            entry.metrics[m.tracker_name(key)] = float(value)
    if (rule := row.alert) is not None:
        entry.metrics[f"alert/{rule}"] = 1.0
        entry.events["alert"] = f"{row.text(m.ALERT_SEVERITY) or 'warning'}: {rule} at step {entry.step}"
    if row.get(m.CHECKPOINT_SAVED):
        entry.events["checkpoint"] = f"saved at step {entry.step} in {row.get(m.CHECKPOINT_TIME_S) or 0:.1f} s"
    elif row.get(m.CHECKPOINT_FAILED):
        entry.events["checkpoint"] = f"failed at step {entry.step}: {row.text(m.ERROR) or ''}"
    version = row.get(m.CONFIG_VERSION)
    if isinstance(version, int) and last_config_version is not None and version != last_config_version:
        entry.events["config"] = f"config version {version} in force from step {entry.step}"
    return entry


class Tracker(Protocol):
    """One tracker run; created (or resumed) when opened."""

    def log(self, entry: TrackerEntry) -> None: ...

    def close(self) -> None: ...


def require(module: str, tracker: str) -> Any:
    """``module`` of the tracker ``tracker``, imported; TrackerUnavailable naming the extra when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise TrackerUnavailable(
            f"telemetry.report_to names {tracker}, but {error.name or module} is not installed: "
            f"pip install 'rlpipe[{EXTRA}]'"
        ) from None


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys, for trackers whose parameters are flat."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat |= _flat(value, name + ".")
        else:
            flat[name] = value
    return flat


class TensorBoardTracker:
    """Event files in ``<run dir>/tensorboard``: scalars per metric, text per event kind, the config as text."""

    def __init__(self, log_dir: Path, config: Mapping[str, Any]):
        require("tensorboard", "tensorboard")
        summary = require("torch.utils.tensorboard", "tensorboard")
        self.writer = summary.SummaryWriter(log_dir=str(log_dir))
        self.writer.add_text("config", "```\n" + yaml.safe_dump(dict(config), sort_keys=False) + "```", 0)

    def log(self, entry: TrackerEntry) -> None:
        for name, value in entry.metrics.items():
            self.writer.add_scalar(name, value, entry.step)
        for kind, text in entry.events.items():
            self.writer.add_text(f"events/{kind}", text, entry.step)
        # A reader (TensorBoard, the run's report) sees each row now, not at the writer's next 2-minute flush.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """An MLflow run tagged ``rlpipe.run_id``, found again on resume; the config as parameters at creation."""

    RUN_TAG = "rlpipe.run_id"

    def __init__(
        self, tracking_uri: str, experiment: str, run_id: str, artifacts: Path | None, config: Mapping[str, Any]
    ):
        mlflow_client = require("mlflow.tracking", "mlflow")
        self.entities = require("mlflow.entities", "mlflow")
        self.client = mlflow_client.MlflowClient(tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id
            if found is not None
            else self.client.create_experiment(experiment, artifact_location=artifacts and artifacts.as_uri())
        )
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.`{self.RUN_TAG}` = '{run_id}'")
        if runs:
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(
                experiment_id, run_name=run_id, tags={self.RUN_TAG: run_id}
            ).info.run_id
            # Parameters cannot change once logged: a resumed run's changes arrive as config events instead.
            params = [self.entities.Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, entry: TrackerEntry) -> None:
        millis = int(time.time() * 1000)
        metrics = [
            self.entities.Metric(name, value, millis, entry.step)
            for name, value in entry.metrics.items()
            if math.isfinite(value)  # MLflow stores no NaN or infinity; metrics.jsonl keeps them
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)
        for kind, text in entry.events.items():
            self.client.set_tag(self.run_id, f"rlpipe.last_{kind}", text)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED")


class WandbTracker:
    """A W&B run whose id is the run id (resumed, not duplicated), offline into ``<run dir>/wandb`` by default."""

    def __init__(self, project: str, mode: str, run_id: str, run_dir: Path, config: Mapping[str, Any]):
        wandb = require("wandb", "wandb")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=run_id,
            id=run_id,
            resume="allow",
            mode=mode,
            dir=str(run_dir),
            config=dict(config),
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, entry: TrackerEntry) -> None:
        self.run.log(entry.metrics, step=entry.step)
        for kind, text in entry.events.items():
            self.run.summary[f"last_{kind}"] = text

    def close(self) -> None:
        self.run.finish()


class TrackerFanout:
    """Every metrics row to every opened tracker; one tracker's failure is logged, the others still get the row."""

    def __init__(self, trackers: dict[str, Tracker]):
        self.trackers = trackers
        self.config_version: int | None = None
        self.failing: set[str] = set()  # logged once until the tracker works again

    def write(self, values: Mapping[str, Any]) -> None:
        row = MetricsRow(values)
        entry = tracker_entry(row, self.config_version)
        if isinstance(version := row.get(m.CONFIG_VERSION), int):
            self.config_version = version
        # Steps only grow in a tracker: a row without a step (none today) would land at step 0.
        for name, tracker in self.trackers.items():
            try:
                tracker.log(entry)
            except Exception as error:  # a dashboard's outage must not stop training; metrics.jsonl has the row
                if name not in self.failing:
                    log_event(log, Event.TRACKER_FAILED, level=logging.WARNING, tracker=name, error=repr(error)[:300])
                self.failing.add(name)
            else:
                self.failing.discard(name)

    def close(self) -> None:
        for name, tracker in self.trackers.items():
            try:
                tracker.close()
            except Exception as error:  # closing one must not keep the others from flushing
                log_event(log, Event.TRACKER_FAILED, level=logging.WARNING, tracker=name, error=repr(error)[:300])


def _open(name: str, telemetry: TelemetryConfig, run_id: str, run_dir: Path, config: Mapping[str, Any]) -> Tracker:
    if name == "tensorboard":
        return TensorBoardTracker(run_dir / "tensorboard", config)
    if name == "mlflow":
        # The local store keeps artifacts beside it; a configured store or server decides for itself.
        uri, artifacts = telemetry.mlflow_tracking_uri, None
        if not uri:
            uri, artifacts = f"sqlite:///{run_dir / 'mlflow.db'}", run_dir / "mlflow-artifacts"
        return MlflowTracker(uri, telemetry.mlflow_experiment, run_id, artifacts, config)
    return WandbTracker(telemetry.wandb_project, telemetry.wandb_mode, run_id, run_dir, config)


def open_trackers(cfg: RunConfig) -> TrackerFanout | None:
    """The trackers ``telemetry.report_to`` names, opened (or resumed) for this run; None when it names none.

    Raises TrackerUnavailable naming the extra when a tracker's library is missing; a tracker that fails to
    open otherwise (its server away) is logged and left out, so the run trains without it.
    """
    telemetry = cfg.telemetry
    if not telemetry.report_to:
        return None
    config = redacted_dump(cfg)
    run_dir = cfg.run_dir.resolve()
    trackers: dict[str, Tracker] = {}
    for name in telemetry.report_to:
        try:
            trackers[name] = _open(name, telemetry, cfg.run_id, run_dir, config)
        except TrackerUnavailable:
            raise
        except Exception as error:  # a tracking server away at start: train without it rather than not at all
            log_event(log, Event.TRACKER_FAILED, level=logging.WARNING, tracker=name, error=repr(error)[:300])
    log_event(log, Event.TRACKERS_OPEN, trackers=list(trackers))
    return TrackerFanout(trackers)
