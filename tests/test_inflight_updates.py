"""In-flight weight updates in a whole run (rollout.inflight_updates, issue "The frontier" item 1): the rollout loads
each new version between chunks of the samples it is generating, so completions mix versions token by token; the
trainer bounds their staleness by their oldest token, and every fed group keeps exactly one fate in the lineage of
the final model.

The rollout generates with transformers (``rollout.backend: hf``), one token a chunk: the tiny model answers in two
or three tokens, so a version published while a batch generates lands between two of its tokens.
"""

from __future__ import annotations

import pytest

from services.common.observe import metrics as m
from services.trainer.checkpointing.lineage import Lineage, effective_steps
from tests.support.fates import assert_every_fed_prompt_accounted_once
from tests.support.runs import config_file, run_pipeline

pytestmark = pytest.mark.e2e


def test_versions_change_mid_sample_and_every_fed_group_is_applied_dropped_or_in_flight_exactly_once(
    tiny_model, tmp_path
):
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="inflight",
        train={"total_steps": 10, "batch_size": 4, "max_inflight_batches": 2, "max_staleness": 2},
        checkpoint={"save_every_steps": 5, "keep_last": 10},
        rollout={"backend": "hf", "prompts_per_batch": 4, "inflight_updates": True, "inflight_chunk_tokens": 1},
    )
    done, rows = run_pipeline(config)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [row for row in rows if row.is_step]
    assert [row.step for row in steps] == list(range(1, 11))
    mixed = [row[m.MIXED_VERSION_FRACTION] for row in steps]
    assert max(mixed) > 0, f"no completion mixed versions in 10 steps: the test proves nothing ({mixed})"
    # A completion is as stale as its oldest token: none older than train.max_staleness was trained on.
    assert all(row[m.STALENESS_MAX] <= 2 for row in steps)

    final = effective_steps(Lineage(runs / "inflight" / "lineage.jsonl").records())
    assert [record.step for record in final] == list(range(1, 11))
    assert_every_fed_prompt_accounted_once(runs, "inflight", final)
