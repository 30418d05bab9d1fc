"""Elastic rollouts in a live local run: `rlpipe scale rollout` takes a training run from 1 rollout to 3 and back to 1.

The two rollouts scaled away drain (finish or hand back the batch they hold) and are gone: not restarted, not in
run.json, not in `rlpipe status`. The lineage of the final model must then account for every fed prompt exactly
once, as after a crash (tests/test_recovery.py), and events.jsonl must say who scaled what from how many to how many.

The rollouts generate with transformers (``rollout.backend: hf``): the engine is not what is under test here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.trainer.checkpointing.lineage import Lineage, effective_steps
from tests.support.fates import assert_every_fed_prompt_accounted_once
from tests.support.runs import (
    config_file,
    metric_rows,
    rlpipe,
    run_info,
    running_pipeline,
    service_events,
    wait_for,
)

pytestmark = pytest.mark.e2e


def stage_replicas(run_dir: Path, role: str) -> tuple[list[str], list[str]]:
    """The replicas of ``role`` that `rlpipe status` lists, and those of them up."""
    shown = rlpipe(run_dir, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    services = [s for s in json.loads(shown.stdout)["services"] if s["role"] == role]
    return sorted(s["instance"] for s in services), sorted(s["instance"] for s in services if s["up"])


@pytest.mark.timeout(900)
def test_rollouts_scaled_up_and_down_mid_run_lose_and_repeat_no_group(tiny_model, tmp_path):
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="elastic",
        train={
            "total_steps": 10_000,  # stopped by the test once the scaled run has trained on
            "batch_size": 8,
            "learning_rate": 2e-5,
            "max_inflight_batches": 2,
            "max_staleness": 3,
        },
        checkpoint={"save_every_steps": 5, "keep_last": 10},
        nats={"ack_wait_s": 10, "heartbeat_s": 3, "max_deliver": 5, "duplicate_window_s": 600},
        rollout={"backend": "hf", "prompts_per_batch": 4},
    )
    run_dir = runs / "elastic"
    with running_pipeline(config) as process:
        run_info(run_dir, process)
        steps = lambda: [r for r in metric_rows(run_dir) if r.is_step]  # noqa: E731
        wait_for(lambda: len(steps()) >= 2, "the first steps", process)

        refused = rlpipe(run_dir, "scale", "trainer", "2")
        assert refused.returncode == 1 and "the trainer does not scale" in " ".join(refused.stderr.split())

        up = rlpipe(run_dir, "scale", "rollout", "3", "--author", "tester", "--wait")
        assert up.returncode == 0, up.stderr
        assert "rollout: 1 -> 3 replicas asked" in up.stdout and "rollout: 3 replicas up" in up.stdout
        listed, running = stage_replicas(run_dir, "rollout")
        assert listed == running == ["rollout-0", "rollout-1", "rollout-2"]
        assert {"rollout-1", "rollout-2"} <= run_info(run_dir, process)["services"].keys()
        seen = len(steps())
        wait_for(lambda: len(steps()) >= seen + 3, "steps with three rollouts", process)

        down = rlpipe(run_dir, "scale", "rollout", "1", "--author", "tester", "--wait")
        assert down.returncode == 0, down.stderr
        assert stage_replicas(run_dir, "rollout") == (["rollout-0"], ["rollout-0"])  # gone, not down
        info = run_info(run_dir, process)
        assert not {"rollout-1", "rollout-2"} & (info["services"].keys() | info["pids"].keys())
        seen = len(steps())
        wait_for(lambda: len(steps()) >= seen + 2, "steps after the scale-down", process)
        assert rlpipe(run_dir, "stop").returncode == 0
        output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]

    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    scaled = [(e["role"], e["before"], e["after"], e["author"]) for e in events if e["kind"] == "scaled"]
    assert scaled == [("rollout", 1, 3, "tester"), ("rollout", 3, 1, "tester")]
    # Scaled away is not crashed: neither was restarted, each drained and stopped, and they had worked.
    assert json.loads((run_dir / "run.json").read_text())["restarts"] == {}
    handled = 0
    for name in ("rollout-1", "rollout-2"):
        said = [e["event"] for e in service_events(run_dir, name)]
        assert said[-1] == "stopped" and "draining" in said and "crashed" not in said, (name, said[-5:])
        handled += next(e["handled"] for e in service_events(run_dir, name) if e["event"] == "draining")
    assert handled > 0, "the replicas scaled away never took work: the test proves nothing about their drain"

    final = effective_steps(Lineage(run_dir / "lineage.jsonl").records())
    assert [r.step for r in final] == list(range(1, len(final) + 1))
    assert_every_fed_prompt_accounted_once(runs, "elastic", final)
