"""Exactly once, judged on a finished run: every group it fed has one fate in the lineage of its final model."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.common.config import CheckpointConfig
from services.common.transport.storage import open_store
from services.trainer.checkpointing.lineage import Lineage, StepRecord, lost_groups
from services.trainer.checkpointing.store import CheckpointStore


def assert_every_fed_prompt_accounted_once(
    runs: Path,
    run_id: str,
    final: list[StepRecord],
    dead: frozenset[str] = frozenset(),
    allow_lost: bool = False,
) -> None:
    """Every fed group has exactly one fate in the lineage of the final model: applied, dropped as stale,
    dead-lettered (``dead``), written off as lost (only with ``allow_lost``: a run whose broker kept every
    message loses none), or still in flight at the end; and only the newest
    ``(max_inflight_batches + 1) * batch_size`` fed groups may still be in flight (no slot leaked): the feed keeps
    ``max_inflight_batches * batch_size`` groups in flight besides those already taken into the batch being
    collected, which a run stopped mid-batch leaves unapplied too."""
    applied = [group for r in final for group, _ in r.groups]
    dropped = [group for r in final for group in r.dropped_stale]
    assert len(applied) == len(set(applied)), "a group was applied twice"
    assert not set(applied) & set(dropped) and len(dropped) == len(set(dropped))
    lost = set(lost_groups(Lineage(runs / run_id / "lineage.jsonl").records()))
    assert allow_lost or not lost, f"groups written off as lost: {sorted(lost)}"
    train = yaml.safe_load((runs / run_id / "effective-config.yaml").read_text())["train"]
    store = CheckpointStore(open_store(runs.resolve().as_uri(), CheckpointConfig()), run_id, keep_last=10)
    state = store.load(final[-1].step).state
    assert state.data_cursor["epoch"] == 0
    fed = [f"e0-i{i}" for i in range(state.data_cursor["index"])]
    in_flight = set(state.in_flight)
    fates = [set(applied), set(dropped), set(dead), lost, in_flight]
    assert set().union(*fates) == set(fed), "a fed prompt's group was lost"
    assert sum(len(f) for f in fates) == len(fed), "a group has two fates"
    newest = set(fed[-(train["max_inflight_batches"] + 1) * train["batch_size"] :])
    assert in_flight <= newest, f"in-flight slots leaked: {sorted(in_flight - newest)}"
