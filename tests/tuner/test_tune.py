"""``rlpipe tune`` end to end with real trials: each a real ``rlpipe run`` of the tiny model.

Trials are kept tiny (2 steps) or end early by design (a limit, a crash), so the file runs in a few
minutes on two cores. Each test reads the study back from its storage, as ``rlpipe tune status`` does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from services.common.config import load_config
from services.common.observe.usage import USAGE_FILE, run_quantities
from services.tuner.records import TrialRecord, records
from services.tuner.study import Tuner, open_storage, open_study
from services.tuner.tune_file import load_tune_file
from tests.support.paths import ROOT
from tests.support.runs import config_file
from tests.support.tuner import TUNE, alive, runnable_tune_file

pytestmark = pytest.mark.integration


@pytest.fixture
def base(tmp_path: Path, tiny_model: tuple[Path, Path]) -> Path:
    return config_file(
        tmp_path, tiny_model, "base.yaml", rollout={"backend": "hf", "prompts_per_batch": 16}, train={"total_steps": 2}
    )


ENDLESS_STEPS = 100_000


def endless_base(tmp_path: Path, tiny_model: tuple[Path, Path]) -> Path:
    """A base config whose runs have steps for far longer than any test waits: its trials end at their limits."""
    return config_file(
        tmp_path,
        tiny_model,
        "endless.yaml",
        rollout={"backend": "hf", "prompts_per_batch": 16},
        train={"total_steps": ENDLESS_STEPS},
    )


def study_records(path: Path) -> list[TrialRecord]:
    spec, _ = load_tune_file(path)
    return records(open_study(spec, open_storage(spec)))


def broken_model(tmp_path: Path) -> Path:
    """A model folder the config accepts (it has a config.json) that no run can load: it fails at start."""
    folder = tmp_path / "broken-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return folder


def test_a_trial_that_crashes_is_failed_and_the_study_goes_on_to_a_complete_one(tmp_path, base, tiny_model):
    broken, good = str(broken_model(tmp_path)), str(tiny_model[0])
    path = runnable_tune_file(
        tmp_path,
        base,
        space={"model.path": {"type": "categorical", "choices": [broken, good]}},
        enqueue=[{"model.path": broken}, {"model.path": good}],
        budget={"max_trials": 2},
        # A usage. constraint: read from the complete trial's usage.json once its run has ended.
        objective={"metric": "eval_accuracy", "constraints": [{"metric": "usage.cpu_core_hours", "below": 1.0}]},
    )
    done = subprocess.run([*TUNE, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    crashed, complete = study_records(path)

    assert (crashed.status, crashed.state, crashed.params) == ("failed", "FAIL", {"model.path": broken})
    # Refused by the launcher's start-up checks (exit 2), with the launcher's own words as the reason.
    assert crashed.end.reason.startswith("rlpipe run exited with 2: rlpipe run: run start-up checks failed: model:")
    assert "the tokenizer is empty" in crashed.end.reason and crashed.end.exit_code == 2
    assert crashed.end.objective is None and crashed.end.steps == 0

    assert (complete.status, complete.state, complete.params) == ("complete", "COMPLETE", {"model.path": good})
    end, start = complete.end, complete.start
    assert end.steps == 2 and end.reason == ""
    assert end.objective == end.final_metrics["eval_accuracy"]
    assert 0.0 <= end.objective <= 1.0
    assert end.peak_rss_gb > 0.2 and end.wall_s > 0 and end.exit_code == 0
    used = run_quantities(json.loads((Path(complete.start.run_dir) / USAGE_FILE).read_text()))["cpu_core_hours"]
    assert 0 < used < 1.0 and end.constraints == [0.0, pytest.approx(used - 1.0)]
    assert crashed.end.constraints == [0.0, 1.0]  # no usage.json: never measured, so infeasible
    assert start.run_id == "s-t1" and start.run_dir == str(tmp_path / "tune" / "runs" / "s-t1")
    trial_cfg = load_config(start.config_path)
    assert trial_cfg.run_id == "s-t1" and str(trial_cfg.model.path) == good
    # Cleaned up: no process of either trial left, the broker store of the complete one deleted, its checkpoints kept.
    assert alive(crashed.start.pgid) == [] and alive(start.pgid) == []
    assert not (Path(start.run_dir) / "nats").exists()
    assert sorted(p.name for p in Path(start.run_dir).glob("step-*")) == ["step-00000002"]

    # The table, the report and the best config, as `rlpipe tune FILE` writes them at the end.
    assert "│ 0 │ failed" in done.stdout and "│ 1 │ complete" in done.stdout
    assert (tmp_path / "tune" / "report" / "report.html").is_file()
    assert (tmp_path / "tune" / "report" / "history.png").is_file()
    best = load_config(tmp_path / "tune" / "best.yaml")  # what `rlpipe run` loads
    assert best.run_id == "s-best" and str(best.model.path) == good and best.train.total_steps == 2
    assert best.runs_dir == tmp_path / "runs" and best.admin.port == 50052  # the base's, not the trial's

    status = subprocess.run([*TUNE, "status", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and "│ 1 │ complete" in status.stdout and "│ 0 │ failed" in status.stdout


def test_a_trial_past_its_time_limit_is_a_timeout_and_the_study_goes_on(tmp_path, tiny_model):
    # However fast the machine, no trial ends on its own within 6 s.
    trial = {"max_steps": None, "max_wall_s": 6, "stop_grace_s": 5, "poll_s": 0.2}
    spec, cfg = load_tune_file(
        runnable_tune_file(tmp_path, endless_base(tmp_path, tiny_model), budget={"max_trials": 2}, trial=trial)
    )
    tuner = Tuner(spec, cfg)
    assert tuner.run() == "budget.max_trials (2) reached"
    found = records(tuner.study)
    assert [(r.number, r.status, r.state) for r in found] == [(0, "timeout", "FAIL"), (1, "timeout", "FAIL")]
    for r in found:
        assert r.end.reason.startswith(f"trial.max_wall_s (6s) at step {r.end.steps}"), r.end.reason
        assert r.end.steps < ENDLESS_STEPS
        assert 6 <= r.end.wall_s < 6 + 5 + 5  # the limit, then at most the grace
        assert alive(r.start.pgid) == []


def test_a_trial_past_its_memory_limit_is_oom_infeasible_and_the_study_goes_on(tmp_path, base):
    spec, cfg = load_tune_file(runnable_tune_file(tmp_path, base, budget={"max_trials": 2}, trial={"max_rss_gb": 0.25}))
    tuner = Tuner(spec, cfg)
    assert tuner.run() == "budget.max_trials (2) reached"
    found = records(tuner.study)
    assert [(r.number, r.status, r.state) for r in found] == [(0, "oom", "COMPLETE"), (1, "oom", "COMPLETE")]
    for r in found:
        assert "> trial.max_rss_gb 0.25" in r.end.reason
        assert r.end.peak_rss_gb > 0.25 and r.end.constraints == [1.0]
        assert alive(r.start.pgid) == []
    # Optuna holds the constraint, so samplers rank the configuration below every feasible one.
    assert [t.constraints for t in tuner.study.trials] == [{"oom": 1.0}, {"oom": 1.0}]


def test_the_tuner_killed_mid_trial_and_restarted_keeps_finished_trials_and_leaves_no_orphan(tmp_path, tiny_model):
    # Every trial ends at its time limit (it has steps for far longer), so each takes a known time; trial 1 is the
    # one the tuner dies in. The limit is the window in which the poll below must see trial 1 under way: on a
    # loaded host (another test worker beside this one) its start alone took most of 12 s, so the window is 20 s.
    path = runnable_tune_file(
        tmp_path,
        endless_base(tmp_path, tiny_model),
        budget={"max_trials": 3},
        trial={"max_steps": None, "max_wall_s": 20, "stop_grace_s": 5},
    )
    tuner = subprocess.Popen([*TUNE, str(path)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert tuner.poll() is None and time.monotonic() < deadline, "trial 1 never got under way"
            found = study_records(path) if (tmp_path / "tune" / "study.journal").exists() else []
            if len(found) == 2 and found[1].start and found[1].start.pgid and len(alive(found[1].start.pgid)) >= 2:
                break  # the launcher and at least nats-server of trial 1 are up
            time.sleep(0.3)
        finished = found[0]
        interrupted_pgid = found[1].start.pgid
        os.kill(tuner.pid, signal.SIGKILL)
        tuner.wait()
    finally:
        if tuner.poll() is None:
            tuner.kill()
    # The trial's launcher dies with its tuner, and its services with it: nothing is orphaned.
    deadline = time.monotonic() + 15
    while alive(interrupted_pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(interrupted_pgid) == []

    again = subprocess.run([*TUNE, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert again.returncode == 0, again.stderr[-3000:]
    found = study_records(path)
    assert [(r.number, r.status) for r in found] == [(0, "timeout"), (1, "failed"), (2, "timeout")]
    assert found[0].start == finished.start and found[0].end == finished.end  # kept as it was, not run again
    assert found[1].end.reason.startswith("interrupted: the tuner (pid ")
    assert found[1].start.pgid == interrupted_pgid
    assert len({tuple(r.params.items()) for r in found}) == 3
    assert not (Path(found[1].start.run_dir) / "nats").exists()
    assert all(alive(r.start.pgid) == [] for r in found)
