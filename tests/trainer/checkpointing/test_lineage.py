"""lineage.jsonl survives a crash mid-write, and says which steps and groups make up the model."""

import os

import pytest

from services.trainer.checkpointing import lineage as lineage_module
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
    assert lost_groups(records) == ["e0-i9"]  # a rollback keeps its process's write-offs
    assert lineage.abandoned_versions() == [(2, 3)]
    assert lineage.max_version() == 4


def test_a_write_off_after_the_checkpoint_a_resume_adopts_is_forgotten_with_the_process_that_made_it(tmp_path):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    lineage.record_step(1, 1, [("e0-i0", 0)], [], 5)
    lineage.record_lost(1, ["e0-i1"])  # after step 1's checkpoint: a resume from 1 never knew it
    lineage.record_step(2, 2, [("e0-i2", 1)], [], 9)
    lineage.restart_from(1, 3, "resume")
    lineage.record_step(2, 3, [("e0-i1", 2)], [], 12)  # the group came back, and the new branch applied it
    assert lost_groups(lineage.records()) == []
    lineage.record_lost(2, ["e0-i3"])
    lineage.restart_from(2, 4, "restart")
    assert lost_groups(lineage.records()) == []  # made at step 2, after the checkpoint of step 2 was taken


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
    # Every reader meets it: none of them works on around the line.
    with pytest.raises(LineageError):
        lineage.max_version()
    with pytest.raises(LineageError):
        lineage.restart_from(1, 3, "resume")
    assert lineage.path.read_text().count("\n") == 3  # the refused restart wrote nothing


def summary(lineage: Lineage) -> tuple:
    """What the trainer asks of the lineage between steps, as its index answers it."""
    index = lineage.catch_up()
    return index.max_version, index.steps, lineage.abandoned_versions(), sorted(index.requested_resumes)


def whole_file_summary(records: list) -> tuple:
    """The same, from a parse of the whole file: the oracle the index is judged against."""
    restarts = [r for r in records if isinstance(r, RestartRecord)]
    return (
        max((r.policy_version for r in records if isinstance(r, StepRecord | RestartRecord)), default=0),
        [r.step for r in effective_steps(records)],
        [r.abandoned_versions for r in restarts if r.abandoned_versions is not None],
        sorted(r.from_step for r in restarts if r.event == "resume" and r.requested),
    )


def test_the_index_answers_as_a_parse_of_the_whole_file_does_while_records_are_appended(tmp_path):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    for step in range(1, 6):
        lineage.record_step(step, step, [(f"e0-i{step}", step - 1)], [], step * 10)
    lineage.record_lost(5, ["e0-i9"])
    assert lineage.restart_from(2, 6, "rollback", abandoned_versions=(3, 5)) == [3, 4, 5]
    for step in (3, 4):
        lineage.record_step(step, step + 4, [(f"e1-i{step}", step + 3)], [], step * 10 + 1)
    lineage.record_reopened(4, "e0-i9", 3)
    assert lineage.restart_from(3, 9, "resume", requested=True) == [4]
    lineage.record_step(4, 10, [("e2-i0", 9)], [], 50)
    expected = whole_file_summary(lineage.records())
    assert expected == (10, [1, 2, 3, 4], [(3, 5)], [3])
    assert summary(lineage) == expected
    assert summary(Lineage(lineage.path)) == expected  # a restart reads the whole file once and agrees


def test_a_read_parses_only_the_lines_appended_since_the_last_read(tmp_path, monkeypatch):
    """A save reads the lineage (its highest version, its text): 20,000 steps took 3.9 s to parse whole, so a read
    must cost what was appended since the last one, not the run's length."""
    path = tmp_path / "lineage.jsonl"
    earlier = Lineage(path)  # the run so far, as a restarted trainer finds it
    for step in range(1, 201):
        earlier.record_step(step, step, [(f"e0-i{step}", step - 1)], [], step)
    parsed: list[str] = []
    parse = lineage_module.parse_record
    monkeypatch.setattr(
        lineage_module, "parse_record", lambda line, where: (parsed.append(where), parse(line, where))[1]
    )
    lineage = Lineage(path)
    assert lineage.max_version() == 200 and len(parsed) == 200  # the first read: the whole file, once
    lineage.record_step(201, 201, [("e0-i201", 200)], [], 201)
    assert lineage.max_version() == 201 and len(parsed) == 200  # its own append: taken as written
    earlier.record_step(202, 202, [("e0-i202", 201)], [], 202)  # another writer's line
    assert lineage.max_version() == 202 and parsed[200:] == [f"{path}:202"]  # read from the last offset


def test_the_text_a_checkpoint_copies_ends_at_the_records_of_its_snapshot(tmp_path):
    lineage = Lineage(tmp_path / "lineage.jsonl")
    assert lineage.text(lineage.catch_up().end) == ""
    lineage.record_step(1, 1, [("e0-i0", 0)], [], 5)
    with lineage.path.open("a") as out:
        out.write('{"step": 2, "policy_version": 2, "gro')  # torn: never a record, never copied
    end = lineage.catch_up().end
    lineage.record_step(2, 2, [("e0-i1", 1)], [], 9)  # appended while the snapshot's copy is being made
    [line] = lineage.text(end).splitlines()
    assert line.startswith('{"v": 1, "step": 1,') and lineage.text(end).endswith("\n")
