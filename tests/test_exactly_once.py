"""Exactly once does not rest on the broker's duplicate window, nor on a checkpoint prefix being clean.

A trainer that comes back after ``nats.duplicate_window_s`` re-feeds prompts from its
checkpoint's cursor; the broker has forgotten them, so they are sampled again and a
second copy of each lands in EXPERIENCE beside the first. The trainer's group ledger
must apply only one of them. And a fresh run must not adopt, prune or purge against an
earlier run's checkpoints under the same prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import nats
import pytest

from services.cli.dead_letters import operator_options
from services.common.config import CheckpointConfig
from services.common.observe import metrics as m
from services.common.transport.storage import open_store
from services.common.transport.streams import DEAD, EXPERIENCE, H_GROUP, PROMPTS, stream_name
from services.trainer.checkpointing.lineage import (
    Lineage,
    LostRecord,
    RestartRecord,
    StepRecord,
    effective_steps,
    lost_groups,
)
from services.trainer.checkpointing.store import CheckpointStore
from tests.support.fates import assert_every_fed_prompt_accounted_once
from tests.support.paths import ROOT
from tests.support.runs import (
    RLPIPE_RUN,
    config_file,
    kill_service,
    metric_rows,
    rlpipe,
    run_info,
    run_pipeline,
    running_pipeline,
    service_events,
    wait_for,
)

pytestmark = pytest.mark.e2e

TOTAL_STEPS = 24
SAVE_EVERY = 10
WINDOW_S = 5.0


def test_a_trainer_back_after_the_duplicate_window_applies_no_group_twice(tiny_model, tmp_path):
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="late",
        train={"total_steps": TOTAL_STEPS, "batch_size": 8, "learning_rate": 2e-5, "max_inflight_batches": 2},
        checkpoint={"save_every_steps": SAVE_EVERY, "keep_last": 10},
        nats={"ack_wait_s": 2, "heartbeat_s": 1, "max_deliver": 2, "duplicate_window_s": WINDOW_S},
        # The ledger is under test, not the engine: the transformers rollout is enough (docs/testing.md).
        rollout={"backend": "hf", "prompts_per_batch": 4},
    )
    run_dir = runs / "late"
    with running_pipeline(config) as process:
        steps = lambda: [r for r in metric_rows(run_dir) if r.is_step]  # noqa: E731
        # Three steps past the checkpoint of step 10: steps 11 on trained on groups fed after its cursor, which
        # the resume feeds again. (The resume is pinned to step 10: the kill may come after step 20's save.)
        wait_for(lambda: len(steps()) >= SAVE_EVERY + 3, "three steps past a checkpoint", process)
        pids = run_info(run_dir, process)["pids"]
        os.kill(pids["trainer"], signal.SIGKILL)  # no final save: the resume goes back to step 10
        process.kill()  # the launcher; its children die with it
        process.wait()
    time.sleep(WINDOW_S + 1.0)  # the time passing is the condition: every dedupe entry of the first run expired

    done = subprocess.run(
        [*RLPIPE_RUN, str(config), f"checkpoint.resume_step={SAVE_EVERY}", "--resume"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

    records = Lineage(run_dir / "lineage.jsonl").records()
    resumes = [r for r in records if isinstance(r, RestartRecord) and r.event == "resume"]
    assert [r.from_step for r in resumes] == [SAVE_EVERY]
    final = effective_steps(records)
    assert [r.step for r in final] == list(range(1, TOTAL_STEPS + 1))
    assert_every_fed_prompt_accounted_once(runs, "late", final)
    # The repeats reached the trainer (the broker no longer filtered them) and were refused there.
    refused = sum((r.get(m.REPEATS_DROPPED) or 0) for r in metric_rows(run_dir) if r.is_step)
    assert refused > 0


def test_a_fresh_run_over_another_runs_checkpoints_is_refused_and_touches_nothing(tiny_model, tmp_path, s3):
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="reuse",
        train={"total_steps": 4},
        checkpoint=s3.checkpoint(save_every_steps=2, keep_last=5),
    )
    first, _ = run_pipeline(config)
    assert first.returncode == 0, first.stdout[-3000:]
    store = CheckpointStore(open_store("s3://ckpt/prefix", CheckpointConfig(**s3.checkpoint())), "reuse", keep_last=5)
    before = store.catalog()
    assert [e.step for e in before] == [2, 4]

    # Started afresh (the local run folder deleted on purpose), the same run id on the same S3 prefix: the old run's
    # steps would be pruned against the new ones, and a crash would resume the old run.
    again = subprocess.run(
        [*RLPIPE_RUN, str(config), "--overwrite"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 2  # the trainer refused (exit 2): not restarted, the run ends with its reason
    assert "rlpipe run: trainer refused to run: " in again.stderr and "holds steps [2, 4]" in again.stderr
    trainer_log = (runs / "reuse" / "logs" / "trainer.log").read_text()
    assert '"start_refused"' in trainer_log
    assert "s3://ckpt/prefix/reuse/ holds steps [2, 4]" in trainer_log and "--resume" in trainer_log
    # Refused once, and not restarted with resume on (which would have adopted the old run's steps).
    assert trainer_log.count('"start_refused"') == 1 and '"resumed"' not in trainer_log
    assert store.catalog() == before


def test_prompts_the_broker_lost_are_written_off_and_the_run_goes_on(tiny_model, tmp_path):
    """Work-queue messages gone from the broker (a lost volume, say) come back neither as experience nor as dead
    letters. Their in-flight slots must not leak: after train.lost_after_s they are recorded as lost, the alert
    fires, and feeding goes on instead of starving with every service up. (The run is stopped once every purged
    group has a fate: written off, or used after all. Left to end at a step count, it could end while the last
    purged groups were still short of lost_after_s, in flight for a reason, and the test would be racing it.)"""
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="leak",
        train={"total_steps": 10_000, "batch_size": 8, "max_inflight_batches": 4, "lost_after_s": 6},
        nats={"ack_wait_s": 2, "heartbeat_s": 1, "max_deliver": 2, "duplicate_window_s": 30},
        rollout={"prompts_per_batch": 4},
    )
    run_dir = runs / "leak"
    with running_pipeline(config) as process:
        wait_for(lambda: any(r.is_step for r in metric_rows(run_dir)), "step 1", process)
        pids = run_info(run_dir, process)["pids"]
        os.kill(pids["rollout-0"], signal.SIGSTOP)  # nothing fetches PROMPTS while we look and purge
        try:
            nats_url = run_info(run_dir, process)["nats_url"]
            purged = asyncio.run(purge_prompts(nats_url, operator_options(run_dir)))
        finally:
            os.kill(pids["rollout-0"], signal.SIGCONT)
        assert len(purged) > 0
        wait_for(lambda: purged <= fated_groups(run_dir), "every purged group written off or used", process)
        # The step being collected when the last group was written off counts it in its metrics row.
        steps_then = sum(r.is_step for r in metric_rows(run_dir))
        wait_for(lambda: sum(r.is_step for r in metric_rows(run_dir)) > steps_then + 1, "two more steps", process)
        assert rlpipe(run_dir, "stop").returncode == 0
        output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]

    records = Lineage(run_dir / "lineage.jsonl").records()
    final = effective_steps(records)
    assert [r.step for r in final] == list(range(1, len(final) + 1))
    used = used_groups(final)
    # A purged prompt the stopped rollout had already fetched still came back; every other one is lost.
    assert set(lost_groups(records)) == purged - used
    assert purged - used
    assert_every_fed_prompt_accounted_once(runs, "leak", final, allow_lost=True)
    rows = metric_rows(run_dir)
    assert sum((r.get(m.GROUPS_LOST) or 0) for r in rows if r.is_step) == len(purged - used)
    # The alert fires when the first groups are written off (not a step later: a stall brings no step row).
    first_loss = next(r.at_step for r in records if isinstance(r, LostRecord))
    assert next(r.step for r in rows if r.alert == "groups_lost") == first_loss
    # And the run's events record each write-off, as they record a rollback that puts groups back in flight.
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert sum(e["count"] for e in events if e["kind"] == "groups_lost") == len(purged - used)


def used_groups(steps: list[dict]) -> set[str]:
    """Groups the lineage's steps applied or dropped as stale."""
    return {g for r in steps for g, _ in r.groups} | {g for r in steps for g in r.dropped_stale}


def fated_groups(run_dir: Path) -> set[str]:
    """Groups that have a fate so far: used by a step, or written off as lost."""
    records = Lineage(run_dir / "lineage.jsonl").records() if (run_dir / "lineage.jsonl").exists() else []
    return used_groups(effective_steps(records)) | set(lost_groups(records))


async def purge_prompts(nats_url: str, options: dict) -> set[str]:
    """Delete the PROMPTS messages the rollouts have not been handed yet; returns their group ids. (One handed out
    just now still comes back from the rollout that holds it: the test counts those as used, not lost.)"""
    nc = await nats.connect(nats_url, **options)
    js = nc.jetstream()
    name = stream_name("leak", PROMPTS)
    delivered = (await js.consumer_info(name, "rollout")).delivered.stream_seq
    last = (await js.stream_info(name)).state.last_seq
    groups = set()
    for seq in range(delivered + 1, last + 1):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            groups.add((await js.get_msg(name, seq)).headers[H_GROUP])
            await js.delete_msg(name, seq)
    await nc.close()
    return groups


def test_a_broker_back_without_its_store_stops_the_trainer_with_a_named_error(tiny_model, tmp_path):
    """A broker that restarts without its volume holds none of the EXPERIENCE the trainer read. Waiting below the
    lost sequence forever, or reading on from sequence 1 as if nothing happened, would both be silent; the trainer
    stops with broker_state_lost instead, and is not restarted into the same state."""
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="lostvol",
        train={"total_steps": 500, "batch_size": 8},
        checkpoint={"save_every_steps": 5, "keep_last": 3},
        rollout={"prompts_per_batch": 4},
    )
    run_dir = runs / "lostvol"
    with running_pipeline(config) as process:
        wait_for(lambda: sum(r.is_step for r in metric_rows(run_dir)) >= 3, "step 3", process)
        broker = run_info(run_dir, process)["pids"]["nats"]
        os.kill(process.pid, signal.SIGSTOP)  # the launcher must not restart the broker before its store is gone
        try:
            os.kill(broker, signal.SIGKILL)
            wait_for_exit(broker)
            shutil.rmtree(run_dir / "nats")
        finally:
            os.kill(process.pid, signal.SIGCONT)
        output, _ = process.communicate(timeout=300)
    # The trainer exits EXIT_REFUSED (2); the launcher does not restart a refusal and ends the run with 2.
    assert process.returncode == 2, output[-3000:]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    lost = [json.loads(line) for line in trainer_log.splitlines() if '"broker_state_lost"' in line]
    # Whichever of the two streams it reads the trainer checks first after the reconnect names the loss.
    assert len(lost) == 1
    assert lost[0]["stream"] in {stream_name("lostvol", EXPERIENCE), stream_name("lostvol", DEAD)}, lost[0]
    assert lost[0]["stream"] in lost[0]["error"]
    assert '"resumed"' not in trainer_log  # not restarted into the same broker
    steps = [r for r in Lineage(run_dir / "lineage.jsonl").records() if isinstance(r, StepRecord)]
    seqs = [r.experience_seq for r in steps]
    assert seqs == sorted(set(seqs))  # nothing re-read from the re-created stream's sequence 1


def wait_for_exit(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # A zombie is dead, only not yet reaped by the stopped launcher.
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still running")


@pytest.mark.e2e
def test_without_periodic_checkpoints_experience_is_purged_and_a_restarted_trainer_reads_on(tiny_model, tmp_path):
    """save_every_steps: 0 used to keep EXPERIENCE forever. Now everything read is purged every few steps, and a
    trainer killed before any checkpoint starts over reading after the purge, not stopping on the gap as if the
    broker had lost messages."""
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="nosave",
        train={"total_steps": 30, "batch_size": 8, "learning_rate": 2e-5, "max_inflight_batches": 2},
        checkpoint={"save_every_steps": 0},
        rollout={"prompts_per_batch": 4},
        supervision={"backoff_s": 0.5, "stop_grace_s": 60},
    )
    run_dir = runs / "nosave"
    trainer_events = lambda: service_events(run_dir, "trainer")  # noqa: E731
    with running_pipeline(config) as process:
        wait_for(lambda: any(e["event"] == "purged" for e in trainer_events()), "a purge without checkpoints", process)
        kill_service(run_dir, "trainer", process)
        purges = [e["experience_below"] for e in trainer_events() if e["event"] == "purged"]
        output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-3000:]
    events = trainer_events()
    assert not [e for e in events if e["event"] == "broker_state_lost"]
    [replay] = [e for e in events if e["event"] == "replay_purged"]
    assert (replay["read_through"], replay["purged_through"]) == (0, purges[-1] - 1)
    records = Lineage(run_dir / "lineage.jsonl").records()
    final = effective_steps(records)
    assert [r.step for r in final] == list(range(1, 31))
    assert_every_fed_prompt_accounted_once(runs, "nosave", final)
    # What the abandoned incarnation left in flight came back and was set aside, not trained on nor counted.
    assert sum(e["event"] == "foreign_group_dropped" for e in events) > 0
