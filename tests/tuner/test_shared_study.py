"""Trials side by side: ``rlpipe tune --worker`` processes sharing a real PostgreSQL study, a worker that stopped
beating failed by another, and device slots running trials concurrently on one machine."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from services.tuner.records import TrialStart, records, save
from services.tuner.study import Tuner, open_storage, open_study
from services.tuner.tune_file import load_tune_file
from tests.support.paths import ROOT
from tests.support.runs import config_file
from tests.support.tuner import TUNE, alive, runnable_tune_file

pytestmark = pytest.mark.e2e


@pytest.fixture
def base(tmp_path: Path, tiny_model: tuple[Path, Path]) -> Path:
    return config_file(
        tmp_path, tiny_model, "base.yaml", rollout={"backend": "hf", "prompts_per_batch": 16}, train={"total_steps": 1}
    )


# The cheapest trial that still trains and evaluates: one step of the tiny model.
ONE_STEP = {"max_steps": 1, "max_wall_s": 300, "stop_grace_s": 10, "poll_s": 0.2}


@pytest.mark.e2e
def test_two_workers_on_one_postgresql_study_run_disjoint_trials_within_its_budget(tmp_path, base, postgres_url):
    # The tune file names no storage: the one setting the deploy profiles use does (RLPIPE_TUNE_STORAGE).
    path = runnable_tune_file(tmp_path, base, study="two-workers", budget={"max_trials": 4}, trial=ONE_STEP)
    env = {**os.environ, "RLPIPE_TUNE_STORAGE": postgres_url}
    workers = [
        subprocess.Popen(
            [*TUNE, "--worker", str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [worker.communicate(timeout=600) for worker in workers]
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-3000:]
        assert "stopped: budget.max_trials (4) reached" in " ".join(err.split())
    assert not (tmp_path / "tune" / "study.journal").exists()
    spec, _ = load_tune_file(path, postgres_url)
    found = records(open_study(spec, open_storage(spec)))

    # Exactly the budget over both workers, every trial run once, by one of them, in its own run directory.
    assert [r.number for r in found] == [0, 1, 2, 3]
    # Each ran to its own end under the worker that claimed it: none interrupted, none a copy of another. (A
    # trial may fail on its own: two runs at once on a loaded two-core machine can miss a start-up deadline.)
    outcomes = [(r.status, r.end and r.end.reason) for r in found]
    assert all(r.status in ("complete", "failed") and not r.end.reason.startswith("interrupted") for r in found), (
        outcomes
    )
    assert all(r.end.steps == 1 for r in found if r.status == "complete"), outcomes
    assert len({r.params["train.learning_rate"] for r in found}) == 4
    assert len({r.start.run_dir for r in found}) == 4
    assert {r.start.run_id for r in found} == {f"two-workers-t{n}" for n in range(4)}
    assert {r.start.worker_pid for r in found} == {w.pid for w in workers}
    assert all(alive(r.start.pgid) == [] for r in found)

    # The records are read from the shared storage: any machine that can reach it gets the table.
    status = subprocess.run(
        [*TUNE, "status", "--storage", postgres_url, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert status.returncode == 0, status.stderr
    assert all(f"│ {r.number} │ {r.status}" in status.stdout for r in found), status.stdout


@pytest.mark.integration
def test_a_trial_whose_worker_stopped_its_heartbeat_is_failed_by_the_next_worker(tmp_path, base, postgres_url):
    spec, cfg = load_tune_file(
        runnable_tune_file(
            tmp_path,
            base,
            study="stale",
            storage=postgres_url,
            budget={"max_trials": 1},
            parallel={"heartbeat_s": 1, "stale_after_s": 2},
        )
    )
    # A worker on another machine claims a trial, beats once and is lost with its machine.
    elsewhere = Tuner(spec, cfg)
    trial = elsewhere.study.ask()
    trial_id = elsewhere.trial_id(trial.number)
    elsewhere.storage.record_heartbeat(trial_id)
    start = TrialStart("stale-t0", "/elsewhere/runs/stale-t0", "/elsewhere/t0.yaml", "lost-machine", 4242, time.time())
    save(elsewhere.storage, trial_id, start)

    here = Tuner(spec, cfg)
    assert here.stop_reason() == "budget.max_trials (1) reached"  # the running trial holds the budget's one trial
    time.sleep(3)  # the time passing is the condition: past parallel.stale_after_s without a heartbeat
    assert here.run() == "budget.max_trials (1) reached"

    (failed,) = records(here.study)
    assert (failed.number, failed.state, failed.status) == (0, "FAIL", "failed")
    assert failed.end.reason == (
        "interrupted: its worker (lost-machine pid 4242) stopped its heartbeat; failed by another worker"
    )
    assert failed.start == start


@pytest.mark.e2e
def test_device_slots_run_trials_concurrently_each_on_its_own_cuda_visible_devices(tmp_path, base):
    spec, cfg = load_tune_file(
        runnable_tune_file(
            tmp_path, base, budget={"max_trials": 2}, trial=ONE_STEP, parallel={"device_slots": ["0", "1"]}
        )
    )
    tuner = Tuner(spec, cfg)
    assert tuner.run() == "budget.max_trials (2) reached"
    first, second = records(tuner.study)

    assert (first.status, second.status) == ("complete", "complete"), (first.end.reason, second.end.reason)
    # What each launcher was started with, as the kernel holds its environment, and the slot it was given.
    assert {first.start.cuda_visible_devices, second.start.cuda_visible_devices} == {"0", "1"}
    assert first.start.cuda_visible_devices == first.start.device_slot
    assert second.start.cuda_visible_devices == second.start.device_slot
    # Side by side: each started before the other ended.
    assert first.start.started_at < second.end.ended_at and second.start.started_at < first.end.ended_at
    assert alive(first.start.pgid) == [] and alive(second.start.pgid) == []
