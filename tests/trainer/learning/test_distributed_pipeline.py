"""`rlpipe run` with `trainer.nproc: 2`: the trainer runs as two torchrun ranks inside the real pipeline."""

from __future__ import annotations

import json

import pytest

from services.common.config import CheckpointConfig
from services.common.transport.storage import open_store
from services.trainer.checkpointing.lineage import Lineage, effective_steps
from services.trainer.checkpointing.store import CheckpointStore
from tests.support.fates import assert_every_fed_prompt_accounted_once
from tests.support.runs import config_file, run_pipeline

# Whole pipelines, minutes each: the slow tier (make test runs it after the rest).
pytestmark = pytest.mark.e2e


def test_a_two_rank_trainer_trains_saves_and_stops_cleanly_in_the_pipeline(tiny_model, tmp_path):
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="ranks",
        trainer={"nproc": 2},
        train={"total_steps": 4, "batch_size": 8},
        checkpoint={"save_every_steps": 2, "keep_last": 5},
        # The trainer's ranks are under test, not the engine: the transformers rollout starts without vLLM's cost.
        rollout={"backend": "hf", "prompts_per_batch": 16},
        supervision={"stop_grace_s": 60},  # a loaded machine can take longer than 20 s to stop a stage
    )
    done, rows = run_pipeline(config)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    run_dir = runs / "ranks"
    final = effective_steps(Lineage(run_dir / "lineage.jsonl").records())
    assert [r.step for r in final] == [1, 2, 3, 4]
    assert_every_fed_prompt_accounted_once(runs, "ranks", final)
    store = CheckpointStore(open_store(runs.resolve().as_uri(), CheckpointConfig()), "ranks", keep_last=5)
    assert store.steps() == [2, 4]
    assert store.load(4).state.step == 4
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    events = [json.loads(line) for line in trainer_log.splitlines() if line.startswith("{")]
    rank1 = [e["event"] for e in events if e.get("service") == "trainer-rank1"]
    assert rank1 == ["follower_ready", "follower_stopped"]  # rank 1 ran beside the leader and was let go
    assert "terminate called" not in trainer_log  # the process group was torn down cleanly
    assert sum(1 for r in rows if r.is_step) == 4
