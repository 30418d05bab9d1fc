"""Killed services come back and no sample is lost or applied twice.

`rlpipe run` supervises its processes; here the trainer is SIGKILLed between
checkpoints and a rollout mid-run. The restarted trainer resumes from its last
checkpoint, re-reads EXPERIENCE after the checkpoint's sequence and re-feeds prompts
from the checkpoint's cursor (their repeats are dropped by the stream's duplicate
window). The lineage of the steps that make up the final model must then account for
every fed prompt exactly once: applied, dropped as stale, or still in flight.

The rollouts generate with transformers (``rollout.backend: hf``): the engine is not what is under test here.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from services.common.observe import metrics as m
from services.trainer.checkpointing.lineage import (
    Lineage,
    LostRecord,
    RestartRecord,
    StepRecord,
    effective_steps,
)
from tests.support.fates import assert_every_fed_prompt_accounted_once
from tests.support.runs import config_file, kill_service, metric_rows, rlpipe, running_pipeline, wait_for

# Whole pipelines, minutes each: the slow tier (make test runs it after the rest).
pytestmark = pytest.mark.e2e

TOTAL_STEPS = 14
BATCH = 8
INFLIGHT_BATCHES = 2
ACK_WAIT_S = 10


def test_killed_trainer_and_rollout_recover_with_every_group_applied_once(tiny_model, tmp_path):
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="chaos",
        train={
            "total_steps": 10_000,  # stopped by the test once the killed rollout's prompts came back
            "batch_size": BATCH,
            "learning_rate": 2e-5,
            "max_inflight_batches": INFLIGHT_BATCHES,
            "max_staleness": 3,
        },
        checkpoint={"save_every_steps": 3, "keep_last": 10},
        nats={"ack_wait_s": ACK_WAIT_S, "heartbeat_s": 3, "max_deliver": 5, "duplicate_window_s": 600},
        rollout={"backend": "hf", "prompts_per_batch": 4},
        supervision={"backoff_s": 0.5},
    )
    run_dir = runs / "chaos"
    with running_pipeline(config) as process:
        steps = lambda: [r for r in metric_rows(run_dir) if r.is_step]  # noqa: E731
        # Kill the trainer after step 5: the last checkpoint is 3 or 6, the steps after it must be redone.
        wait_for(lambda: len(steps()) >= 5, "step 5", process)
        killed_at = time.time()
        kill_service(run_dir, "trainer", process)
        wait_for(
            lambda: json.loads((run_dir / "run.json").read_text())["restarts"].get("trainer") == 1,
            "trainer restart",
            process,
        )
        wait_for(lambda: any(r[m.TIME] > killed_at for r in steps()), "a step after the restart", process)
        trainer_recovery_s = min(r[m.TIME] for r in steps() if r[m.TIME] > killed_at) - killed_at
        kill_service(run_dir, "rollout-0", process)
        rollout_killed_at = time.monotonic()
        # The prompts the killed rollout held come back once their ack wait runs out, to the restarted rollout. A
        # run that ended before that would leave them in flight (a fate, but no proof); one whose groups never come
        # back has leaked their slots, and this wait times out on it.
        wait_for(
            lambda: time.monotonic() > rollout_killed_at + ACK_WAIT_S and not unsettled_behind(run_dir),
            "the killed rollout's prompts to come back and be used",
            process,
        )
        assert rlpipe(run_dir, "stop").returncode == 0
        output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    print(f"trainer kill -> next applied step: {trainer_recovery_s:.1f}s")

    restarts = json.loads((run_dir / "run.json").read_text())["restarts"]
    assert restarts == {"trainer": 1, "rollout-0": 1}
    records = Lineage(run_dir / "lineage.jsonl").records()
    resume = [r for r in records if isinstance(r, RestartRecord) and r.event == "resume"]
    assert len(resume) == 1 and resume[0].from_step % 3 == 0  # a checkpointed step
    before_kill = [r.step for r in records[: records.index(resume[0])] if isinstance(r, StepRecord)]
    assert resume[0].abandoned_steps == [s for s in before_kill if s > resume[0].from_step]
    final = effective_steps(records)
    assert [r.step for r in final] == list(range(1, len(final) + 1))
    assert len(final) > max(before_kill)
    versions = [r.policy_version for r in records if isinstance(r, StepRecord)]
    assert resume[0].policy_version > max(versions[: len(before_kill)])  # versions keep growing across the restart

    assert_every_fed_prompt_accounted_once(runs, "chaos", final)
    # While the trainer was away, rollouts generated with the weights they held instead of failing
    # batches (each failure spends a delivery; a long outage would dead-letter healthy prompts).
    for log in (run_dir / "logs").glob("rollout-*.log"):
        assert '"compute_failed"' not in log.read_text(), log


def unsettled_behind(run_dir: Path) -> set[str]:
    """Groups older than the in-flight window behind the newest group the final model used, with no fate yet:
    held by a killed rollout until their ack wait runs out, or leaked."""
    if not (run_dir / "lineage.jsonl").exists():
        return set()
    final = effective_steps(Lineage(run_dir / "lineage.jsonl").records())
    used = {g for r in final for g, _ in r.groups} | {g for r in final for g in r.dropped_stale}
    indices = [int(g.rpartition("-i")[2]) for g in used]
    if not indices:
        return set()
    behind = max(indices) - (INFLIGHT_BATCHES + 1) * BATCH
    return {f"e0-i{i}" for i in range(behind)} - used


def test_broker_restart_loses_and_duplicates_nothing(tiny_model, tmp_path):
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="broker",
        train={"total_steps": TOTAL_STEPS, "batch_size": 8, "learning_rate": 2e-5},
        checkpoint={"save_every_steps": 3, "keep_last": 10},
        nats={"ack_wait_s": 10, "heartbeat_s": 3, "max_deliver": 5, "duplicate_window_s": 600, "sync_always": True},
        rollout={"backend": "hf", "prompts_per_batch": 4},
        supervision={"backoff_s": 0.5},
    )
    run_dir = runs / "broker"
    broker_pid = lambda: json.loads((run_dir / "run.json").read_text())["pids"]["nats"]  # noqa: E731
    with running_pipeline(config) as process:
        steps = lambda: [r for r in metric_rows(run_dir) if r.is_step]  # noqa: E731
        wait_for(lambda: len(steps()) >= 4, "step 4", process)
        killed_at = time.time()
        # SIGKILL: no shutdown, only what the broker fsynced survives
        killed_pid = kill_service(run_dir, "nats", process)
        steps_at_kill = len(steps())
        # The launcher starts a new nats-server on the same port and store; the services reconnect to it.
        wait_for(lambda: broker_pid() != killed_pid, "the broker restart", process)
        wait_for(lambda: any(r[m.TIME] > killed_at + 1 for r in steps()), "a step after the broker restart", process)
        times = [r[m.TIME] for r in steps()]
        recovery_s = max(b - a for a, b in itertools.pairwise(times) if b > killed_at)  # the outage's gap between steps
        output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    assert steps_at_kill < TOTAL_STEPS, "the broker was killed after the run's work was done"
    restarts = json.loads((run_dir / "run.json").read_text())["restarts"]
    print(f"broker kill -> longest gap between steps: {recovery_s:.1f}s; restarts {restarts}")
    assert restarts == {"nats": 1}  # no service crashed over it
    assert 'sync_interval: "always"' in (run_dir / "nats.conf").read_text()  # quoted: nats_server.py says why
    records = Lineage(run_dir / "lineage.jsonl").records()
    assert not [r for r in records if isinstance(r, RestartRecord | LostRecord)], (
        "the trainer resumed or wrote groups off"
    )
    final = effective_steps(records)
    assert [r.step for r in final] == list(range(1, TOTAL_STEPS + 1))
    # The trainer read EXPERIENCE straight on across the restart: the broker kept every acknowledged
    # message at its sequence (a lost one would have stopped it with BrokerStateLost / StreamGap).
    sequences = [r.experience_seq for r in final]
    assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
    for log in (run_dir / "logs").glob("*.log"):
        text = log.read_text()
        assert '"dead_letter"' not in text and "BrokerStateLost" not in text and "StreamGap" not in text, log
    assert_every_fed_prompt_accounted_once(runs, "broker", final)
