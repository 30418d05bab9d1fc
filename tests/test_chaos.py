"""Chaos: every role SIGKILLed twice at random moments while a run learns.

The run must finish, the lineage of the steps that make up the final model must
account for every fed prompt exactly once, and held-out accuracy must still improve.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from services.common.observe import metrics as m
from services.trainer.checkpointing.lineage import Lineage, RestartRecord, effective_steps
from tests.support.fates import assert_every_fed_prompt_accounted_once
from tests.support.runs import config_file, kill_service, metric_rows, running_pipeline, wait_for

pytestmark = pytest.mark.e2e

TOTAL_STEPS = 60
VICTIMS = ["reward-0", "rollout-0", "reference-0", "trainer", "reward-0", "reference-0", "rollout-0", "trainer"]


@pytest.mark.e2e
def test_every_role_killed_twice_and_the_run_still_learns(tiny_model, tmp_path):
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="chaos-all",
        sampling={"group_size": 8, "max_new_tokens": 6},
        train={
            "total_steps": TOTAL_STEPS,
            "batch_size": 32,
            "learning_rate": 1e-4,
            "warmup_steps": 10,
            "max_inflight_batches": 2,
        },
        data={"eval_every_steps": 0, "eval_size": 500},
        checkpoint={"save_every_steps": 5, "keep_last": 20},
        nats={"ack_wait_s": 10, "heartbeat_s": 3, "max_deliver": 5, "duplicate_window_s": 600},
        rollout={"prompts_per_batch": 16},
        supervision={"backoff_s": 0.5},
    )
    run_dir = runs / "chaos-all"
    rng = random.Random(7)
    with running_pipeline(config) as process:
        steps = lambda: [r for r in metric_rows(run_dir) if r.is_step]  # noqa: E731
        wait_for(lambda: len(steps()) >= 2, "the first steps", process)
        for victim in VICTIMS:
            seen = len(steps())
            # A kill at a random moment: the delay is the chaos test's input, not a wait for anything.
            time.sleep(rng.uniform(0.0, 2.0))
            kill_service(run_dir, victim, process)
            # Let the pipeline apply steps after each kill, so every outage is recovered from.
            wait_for(
                lambda seen=seen: len(steps()) > seen + 1, f"progress after killing {victim}", process, timeout=300
            )
        output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output[-4000:]

    restarts = json.loads((run_dir / "run.json").read_text())["restarts"]
    assert restarts == {"reward-0": 2, "rollout-0": 2, "reference-0": 2, "trainer": 2}, restarts
    records = Lineage(run_dir / "lineage.jsonl").records()
    assert len([r for r in records if isinstance(r, RestartRecord) and r.event == "resume"]) == 2
    final = effective_steps(records)
    assert [r.step for r in final] == list(range(1, TOTAL_STEPS + 1))
    assert_every_fed_prompt_accounted_once(runs, "chaos-all", final)

    evals = [r[m.EVAL_ACCURACY] for r in metric_rows(run_dir) if r.is_eval]
    # Greedy accuracy of an unchanged model is the same to the last row, and a run broken by the kills (weights
    # from the wrong version, a bad resume) loses accuracy: 15 more of 500 right is learning. The gain varies with
    # the tiny model each machine builds: +0.046 on one whose build stopped at 0.384, more on others.
    assert evals[-1] >= evals[0] + 0.03, evals
