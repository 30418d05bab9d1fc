"""Exactly once does not rest on the broker's duplicate window.

A trainer that comes back after ``nats.duplicate_window_s`` re-feeds prompts from its
checkpoint's cursor; the broker has forgotten them, so they are sampled again and a
second copy of each lands in EXPERIENCE beside the first. The trainer's group ledger
must apply only one of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from services.trainer.lineage import Lineage, effective_steps
from tests.conftest import RLPIPE_RUN, ROOT, metric_rows, running_pipeline, wait_for, write_config
from tests.test_recovery import assert_every_fed_prompt_accounted_once

TOTAL_STEPS = 24
SAVE_EVERY = 10
WINDOW_S = 5.0


def test_a_trainer_back_after_the_duplicate_window_applies_no_group_twice(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    runs = tmp_path / "runs"
    config = write_config(
        tmp_path / "c.yaml",
        model_dir,
        data_dir,
        runs,
        run_id="late",
        train={"total_steps": TOTAL_STEPS, "batch_size": 8, "learning_rate": 2e-5, "max_inflight_batches": 2},
        checkpoint={"save_every_steps": SAVE_EVERY, "keep_last": 10},
        nats={"ack_wait_s": 2, "heartbeat_s": 1, "max_deliver": 2, "duplicate_window_s": WINDOW_S},
        rollout={"prompts_per_batch": 4},
    )
    run_dir = runs / "late"
    with running_pipeline(config) as process:
        steps = lambda: [r for r in metric_rows(run_dir) if "pg_loss" in r]  # noqa: E731
        # Three steps past the checkpoint of step 10: steps 13 on trained on groups fed after its cursor, which
        # the resume feeds again. (Steps take a fraction of a second; the next checkpoint is far enough away.)
        wait_for(lambda: len(steps()) >= SAVE_EVERY + 3, "three steps past a checkpoint", process)
        pids = json.loads((run_dir / "run.json").read_text())["pids"]
        os.kill(pids["trainer"], signal.SIGKILL)  # no final save: the resume goes back to step 10
        process.kill()  # the launcher; its children die with it
        process.wait()
    time.sleep(WINDOW_S + 1.0)  # every dedupe entry of the first run has expired

    done = subprocess.run([*RLPIPE_RUN, str(config), "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

    records = Lineage(run_dir / "lineage.jsonl").records()
    resumes = [r for r in records if r.get("event") == "resume"]
    assert [r["from_step"] for r in resumes] == [SAVE_EVERY]
    final = effective_steps(records)
    assert [r["step"] for r in final] == list(range(1, TOTAL_STEPS + 1))
    assert_every_fed_prompt_accounted_once(runs, "late", final)
    # The repeats reached the trainer (the broker no longer filtered them) and were refused there.
    refused = sum(r.get("repeats_dropped", 0) for r in metric_rows(run_dir) if "pg_loss" in r)
    assert refused > 0
