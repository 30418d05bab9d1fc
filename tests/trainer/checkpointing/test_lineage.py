"""lineage.jsonl survives a crash mid-write, and says which steps and groups make up the model."""

import os

import pytest

from services.trainer.checkpointing.lineage import (
    Lineage,
    LineageError,
    LostRecord,
    ReopenedRecord,
    RestartRecord,
    StepRecord,
    effective_steps,
    lost_groups,
    settled_after,
)

# Lines as the trainer wrote them before records carried a format version, one of each kind.
UNVERSIONED = """\
{"step": 1, "policy_version": 1, "groups": [["e0-i0", 0], ["e0-i1", 0]], "dropped_stale": [], "experience_seq": 4}
{"lost": ["e0-i2"], "at_step": 1}
{"step": 2, "policy_version": 2, "groups": [["e0-i3", 1]], "dropped_stale": ["e0-i4"], "experience_seq": 9, \
"filtered": ["e0-i5"]}
{"reopened": "e0-i6", "dead_letter": 7, "at_step": 2}
{"event": "rollback", "from_step": 1, "policy_version": 3, "abandoned_steps": [2], "abandoned_versions": [2, 2]}
{"event": "resume", "from_step": 1, "policy_version": 4, "abandoned_steps": [], "requested": true}
"""

pytestmark = pytest.mark.unit


def test_a_torn_last_line_is_not_a_record_and_the_next_record_replaces_it(tmp_path):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    lineage.record_step(1, 1, [("e0-i0", 0)], [], 5)
    with lineage.path.open("a") as out:
        out.write('{"step": 2, "policy_version": 2, "gro')  # the process died here
    assert [r.step for r in lineage.records()] == [1]
    abandoned = lineage.restart_from(1, 3, "resume")
    assert abandoned == []
    lineage.record_step(2, 4, [("e0-i1", 3)], [], 9)
    records = lineage.records()
    assert [getattr(r, "step", getattr(r, "event", None)) for r in records] == [1, "resume", 2]
    assert lineage.path.read_text().count("\n") == 3


def test_restarts_abandon_later_steps_and_lost_groups_are_listed(tmp_path):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    for step in (1, 2, 3):
        lineage.record_step(step, step, [(f"e0-i{step}", step - 1)], [], step * 10)
    lineage.record_lost(3, ["e0-i9"])
    assert lineage.restart_from(1, 4, "rollback", abandoned_versions=(2, 3)) == [2, 3]
    records = lineage.records()
    assert [r.step for r in effective_steps(records)] == [1]
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
    assert "filtered" not in lineage.path.read_text().splitlines()[0]  # a step without any keeps the old shape
    assert settled_after(lineage.records(), 1) == ["e0-i2", "e0-i3", "e0-i1", "e0-i4"]


def test_a_file_written_before_records_carried_a_version_reads_as_typed_records(tmp_path):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    lineage.path.write_text(UNVERSIONED)
    records = lineage.records()
    assert [type(r) for r in records] == [
        StepRecord,
        LostRecord,
        StepRecord,
        ReopenedRecord,
        RestartRecord,
        RestartRecord,
    ]
    assert records[0].groups == [("e0-i0", 0), ("e0-i1", 0)] and records[0].filtered == []
    assert records[3] == ReopenedRecord(reopened="e0-i6", dead_letter=7, at_step=2)
    assert [r.step for r in effective_steps(records)] == [1]
    assert settled_after(records[:4], 1) == ["e0-i3", "e0-i4", "e0-i5"]
    assert lineage.abandoned_versions() == [(2, 2)]
    assert lineage.resumed_to(1) and lineage.max_version() == 4
    # The next record goes on the same file, with the format version; the old lines stay as they were.
    lineage.record_step(2, 5, [("e0-i7", 4)], [], 12)
    assert lineage.path.read_text().startswith(UNVERSIONED)
    assert lineage.path.read_text().splitlines()[-1].startswith('{"v": 1, "step": 2,')
    assert lineage.records()[-1] == StepRecord(
        step=2, policy_version=5, groups=[("e0-i7", 4)], dropped_stale=[], experience_seq=12
    )


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"step": 2, "policy_version": 2, "gro', "not JSON"),
        ('["step", 2]', "a record is a JSON object, got list"),
        ('{"v": 2, "step": 2, "policy_version": 2}', "lineage format version 2; this build reads 1"),
        ('{"at_step": 2}', "exactly one of the keys ['event', 'lost', 'reopened', 'step'], got ['at_step']"),
        ('{"step": 2, "lost": [], "at_step": 2}', "exactly one of the keys"),
        ('{"step": "two", "policy_version": 2, "groups": [], "dropped_stale": [], "experience_seq": 1}', "step:"),
        ('{"event": "resume", "from_step": 1, "policy_version": 2}', "abandoned_steps: Field required"),
        ('{"event": "reboot", "from_step": 1, "policy_version": 2, "abandoned_steps": []}', "event:"),
        ('{"lost": ["e0-i1"], "at_step": 2, "why": "?"}', "why: Extra inputs are not permitted"),
    ],
)
def test_a_complete_line_that_is_not_a_record_is_named_never_skipped(tmp_path, line, says):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    lineage.record_step(1, 1, [("e0-i0", 0)], [], 5)
    with lineage.path.open("a") as out:
        out.write(line + "\n")
    lineage.record_lost(2, ["e0-i1"])
    with pytest.raises(LineageError, match=f"^{lineage.path}:2: ") as raised:
        lineage.records()
    assert says in str(raised.value)
    # Every reader goes through records(): none of them works on around the line.
    with pytest.raises(LineageError):
        lineage.max_version()
    with pytest.raises(LineageError):
        lineage.restart_from(1, 3, "resume")
    assert lineage.path.read_text().count("\n") == 3  # the refused restart wrote nothing
