import subprocess
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.common.observe import metrics as m
from services.common.observe.records import MetricsRow
from services.common.observe.trackers import TrackerUnavailable, open_trackers, require, tracker_entry
from tests.support.paths import ROOT
from tests.support.runs import LIGHT_RUN, RLPIPE_RUN, config_file, metric_rows, run_pipeline

pytestmark = pytest.mark.integration

STEP_ROW = {
    "time": 1.0,
    "step": 3,
    "policy_version": 3,
    "config_version": 0,
    "pg_loss": 0.5,
    "value_loss": 0.25,
    "reward_mean": 0.75,
    "reward/exact_match/mean": 0.75,
    "response_length_mean": 4.0,
    "memory/host_rss_gb": 0.7,
    "tokens_per_s": 100.0,
    "never_heard_of": 2.0,
}


@pytest.mark.unit
def test_row_keys_map_to_the_common_namespaces_and_wall_time_is_not_a_metric():
    entry = tracker_entry(MetricsRow(STEP_ROW), last_config_version=None)
    assert entry.step == 3
    assert entry.metrics == {
        "actor/policy_version": 3.0,
        "config/version": 0.0,
        "actor/pg_loss": 0.5,
        "critic/vf_loss": 0.25,
        "reward/mean": 0.75,
        "reward/exact_match/mean": 0.75,
        "response_length/mean": 4.0,
        "memory/host_rss_gb": 0.7,
        "perf/throughput_tokens_per_s": 100.0,
        "trainer/never_heard_of": 2.0,
    }
    assert entry.events == {}


@pytest.mark.unit
def test_alerts_checkpoints_and_new_config_versions_become_events():
    alert = tracker_entry(
        MetricsRow({"step": 5, "alert": "kl_too_high", "alert_severity": "warning", "config_version": 0}), 0
    )
    assert alert.metrics["alert/kl_too_high"] == 1.0
    assert alert.events == {"alert": "warning: kl_too_high at step 5"}
    saved = tracker_entry(
        MetricsRow({"step": 6, "checkpoint_saved": 1, "checkpoint_failed": 0, "checkpoint_time_s": 1.25}), 0
    )
    assert saved.events == {"checkpoint": "saved at step 6 in 1.2 s"}
    assert saved.metrics["checkpoint/time_s"] == 1.25
    failed = tracker_entry(MetricsRow({"step": 7, "checkpoint_failed": 1, "error": "S3 down"}), 0)
    assert failed.events == {"checkpoint": "failed at step 7: S3 down"}
    assert tracker_entry(MetricsRow({"step": 8, "config_version": 2}), 1).events == {
        "config": "config version 2 in force from step 8"
    }
    assert tracker_entry(MetricsRow({"step": 8, "config_version": 2}), 2).events == {}


def test_a_missing_tracker_library_is_named_with_the_extra(tiny_model, tmp_path):
    with pytest.raises(TrackerUnavailable, match=r"mlflow.*no_such_tracker_module.*pip install 'rlpipe\[trackers\]'"):
        require("no_such_tracker_module", "mlflow")
    config = config_file(tmp_path, tiny_model, telemetry={"report_to": ["mlflow", "mlflow"]})
    with pytest.raises(ConfigError, match=r"telemetry.report_to: names a tracker twice"):
        load_config(config)
    config = config_file(tmp_path, tiny_model, telemetry={"report_to": ["comet"]})
    with pytest.raises(ConfigError, match=r"telemetry.report_to.0: Input should be 'tensorboard', 'mlflow' or 'wandb'"):
        load_config(config)


def test_wandb_runs_offline_into_the_run_directory_and_a_reopened_run_keeps_its_id(tiny_model, tmp_path):
    config = config_file(tmp_path, tiny_model, run_id="wb-run", telemetry={"report_to": ["wandb"]})
    cfg = load_config(config)
    for step in (1, 2):  # a trainer, then the same run resumed
        trackers = open_trackers(cfg)
        trackers.write({**STEP_ROW, "step": step})
        trackers.close()
    runs = sorted((cfg.run_dir / "wandb").glob("offline-run-*"))
    # What each run directory holds, to tell a missing run from an unflushed one should this ever fail again
    # (it failed once on the size, under load, and has not since).
    held = {run.name: {f.name: f.stat().st_size for f in run.iterdir() if f.is_file()} for run in runs}
    assert len(runs) == 2, held
    for run in runs:
        assert run.name.endswith("-wb-run"), held
        assert held[run.name].get("run-wb-run.wandb", 0) > 0, held


def test_a_tracker_that_cannot_open_is_left_out_and_the_others_get_every_row(tiny_model, tmp_path):
    unwritable = "sqlite:////proc/no-such-dir/mlflow.db"  # what a tracking store that is away looks like at start
    telemetry = {"report_to": ["tensorboard", "mlflow"], "mlflow_tracking_uri": unwritable}
    config = config_file(tmp_path, tiny_model, telemetry=telemetry)
    cfg = load_config(config)
    trackers = open_trackers(cfg)
    assert list(trackers.trackers) == ["tensorboard"]
    trackers.write(STEP_ROW)
    trackers.close()
    assert _tensorboard_scalars(cfg.run_dir / "tensorboard", "actor/pg_loss") == [(3, 0.5)]


def _tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def _mlflow_history(run_dir: Path, run_id: str, key: str) -> tuple[int, list[tuple[int, float]]]:
    """How many MLflow runs carry the run id, and the metric's history in the one that does."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rlpipe")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`rlpipe.run_id` = '{run_id}'")
    assert runs and runs[0].info.run_name == run_id
    history = client.get_metric_history(runs[0].info.run_id, key)
    return len(runs), sorted((metric.step, metric.value) for metric in history)


@pytest.mark.e2e
def test_a_run_reports_to_tensorboard_and_mlflow_and_its_resume_appends_to_the_same_tracker_runs(tiny_model, tmp_path):
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        train={"total_steps": 2, "batch_size": 4, "learning_rate": 1e-3, "max_seq_len": 32},
        checkpoint={"save_every_steps": 2, "keep_last": 2},
        telemetry={"report_to": ["tensorboard", "mlflow"]},
        **LIGHT_RUN,
    )
    done, rows = run_pipeline(config)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = runs / "test"
    losses = {row.step: row[m.PG_LOSS] for row in rows if row.is_step}
    assert sorted(losses) == [1, 2]
    tensorboard = _tensorboard_scalars(run_dir / "tensorboard", "actor/pg_loss")
    assert [(step, pytest.approx(value)) for step, value in tensorboard] == sorted(losses.items())
    # Step 2, the last, is saved once: by the run's end, with the final evaluation (not also by the periodic save).
    assert [step for step, _ in _tensorboard_scalars(run_dir / "tensorboard", "checkpoint/saved")] == [2]
    count, history = _mlflow_history(run_dir, "test", "actor/pg_loss")
    assert count == 1 and history == [(step, pytest.approx(loss)) for step, loss in sorted(losses.items())]

    # Resumed with two more steps (a command-line override): both trackers append to the run they have.
    resumed = subprocess.run(
        [*RLPIPE_RUN, str(config), "--resume", "train.total_steps=4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    losses = {row.step: row[m.PG_LOSS] for row in metric_rows(run_dir) if row.is_step}
    assert sorted(losses) == [1, 2, 3, 4]
    tensorboard = _tensorboard_scalars(run_dir / "tensorboard", "actor/pg_loss")
    assert [(step, pytest.approx(value)) for step, value in tensorboard] == sorted(losses.items())
    count, history = _mlflow_history(run_dir, "test", "actor/pg_loss")
    assert count == 1 and history == [(step, pytest.approx(loss)) for step, loss in sorted(losses.items())]
    assert _mlflow_history(run_dir, "test", "eval/accuracy")[1] != []
