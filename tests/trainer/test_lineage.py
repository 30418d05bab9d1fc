"""lineage.jsonl survives a crash mid-write, and says which steps and groups make up the model."""

import pytest

from services.trainer.lineage import Lineage, effective_steps, lost_groups

pytestmark = pytest.mark.unit


def test_a_torn_last_line_is_not_a_record_and_the_next_record_replaces_it(tmp_path):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    lineage.record_step(1, 1, [("e0-i0", 0)], [], 5)
    with lineage.path.open("a") as out:
        out.write('{"step": 2, "policy_version": 2, "gro')  # the process died here
    assert [r["step"] for r in lineage.records()] == [1]
    abandoned = lineage.restart_from(1, 3, "resume")
    assert abandoned == []
    lineage.record_step(2, 4, [("e0-i1", 3)], [], 9)
    records = lineage.records()
    assert [r.get("step", r.get("event")) for r in records] == [1, "resume", 2]
    assert lineage.path.read_text().count("\n") == 3


def test_restarts_abandon_later_steps_and_lost_groups_are_listed(tmp_path):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    for step in (1, 2, 3):
        lineage.record_step(step, step, [(f"e0-i{step}", step - 1)], [], step * 10)
    lineage.record_lost(3, ["e0-i9"])
    assert lineage.restart_from(1, 4, "rollback", abandoned_versions=(2, 3)) == [2, 3]
    records = lineage.records()
    assert [r["step"] for r in effective_steps(records)] == [1]
    assert lost_groups(records) == ["e0-i9"]
    assert lineage.abandoned_versions() == [(2, 3)]
    assert lineage.max_version() == 4
