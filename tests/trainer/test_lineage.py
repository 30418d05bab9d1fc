"""lineage.jsonl survives a crash mid-write, and says which steps and groups make up the model."""

import os

import pytest

from services.trainer.lineage import Lineage, effective_steps, lost_groups, settled_after

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


def test_every_record_is_fsynced_before_append_returns_and_the_new_file_with_its_folder(tmp_path, monkeypatch):
    """The highest version in the file is the floor for the versions a restart serves: a node crash must not take
    back a record once written (policy versions only grow)."""
    synced: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), fsync(fd))[1])
    lineage = Lineage(tmp_path / "lineage.jsonl")
    lineage.record_step(1, 1, [("e0-i0", 0)], [], 5)
    assert len(synced) == 2  # the record, and the folder that now holds the new file
    lineage.record_step(2, 2, [("e0-i1", 1)], [], 9)
    lineage.restart_from(1, 3, "rollback", abandoned_versions=(2, 2))
    assert len(synced) == 4


def test_only_a_resume_to_a_requested_step_counts_as_that_request_made(tmp_path):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    lineage.restart_from(20, 21, "resume")  # a resume to the newest step, which happened to be 20
    assert not lineage.resumed_to(20)
    lineage.restart_from(20, 22, "resume", requested=True)
    assert lineage.resumed_to(20) and not lineage.resumed_to(10)


def test_a_rollback_undoes_the_groups_dynamic_sampling_filtered_in_the_abandoned_steps(tmp_path):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    lineage.record_step(1, 1, [("e0-i0", 0)], [], 1)
    lineage.record_step(2, 2, [("e0-i2", 1)], ["e0-i3"], 4, filtered=["e0-i1", "e0-i4"])
    assert "filtered" not in lineage.records()[0]  # a step without any keeps the record's old shape
    assert settled_after(lineage.records(), 1) == ["e0-i2", "e0-i3", "e0-i1", "e0-i4"]
