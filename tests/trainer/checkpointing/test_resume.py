"""Choosing the step to resume from, without a store: an unreadable store is never an empty one."""

import pytest

from services.trainer.checkpointing.resume import (
    CheckpointsMissing,
    SavedRecord,
    StoreListing,
    StoreUnreadable,
    fenced_out,
    resume_candidates,
)

pytestmark = pytest.mark.unit

PRIMARY, MIRROR = "s3://ckpt/run", "file:///mirror"


def test_a_store_that_cannot_be_listed_is_not_taken_for_an_empty_one():
    with pytest.raises(StoreUnreadable, match=r"cannot list the checkpoint store \(s3://ckpt/run: timed out\)"):
        resume_candidates([StoreListing(PRIMARY, None, "timed out")], saved_step=None)


def test_a_run_that_never_saved_and_whose_stores_answer_empty_has_nothing_to_resume():
    assert resume_candidates([StoreListing(PRIMARY, []), StoreListing(MIRROR, [])], saved_step=None) == []


def test_an_empty_store_is_missing_steps_when_the_runs_own_record_says_it_saved_one():
    with pytest.raises(CheckpointsMissing, match=r"s3://ckpt/run holds no checkpoint of this run, but step 20"):
        resume_candidates([StoreListing(PRIMARY, [])], saved_step=20)


def test_steps_are_tried_newest_first_and_the_primary_before_the_mirror():
    listings = [StoreListing(PRIMARY, [10, 20]), StoreListing(MIRROR, [10, 20, 15])]
    assert resume_candidates(listings, saved_step=20) == [
        (20, PRIMARY),
        (20, MIRROR),
        (15, MIRROR),
        (10, PRIMARY),
        (10, MIRROR),
    ]


def test_a_step_the_primary_marks_abandoned_is_no_candidate_on_a_mirror_that_missed_the_rollback():
    # A rollback to 10 marked 15 and 20 ABANDONED on the primary while the mirror was out of reach.
    listings = [StoreListing(PRIMARY, [10], abandoned=frozenset({15, 20})), StoreListing(MIRROR, [10, 15, 20])]
    assert resume_candidates(listings, saved_step=10) == [(10, PRIMARY), (10, MIRROR)]
    # The new branch saved 15 again on the primary; the mirror's old 15 is still live there, tried after it, and
    # a mirror's own ABANDONED mark does not disown the primary's copy.
    listings = [
        StoreListing(PRIMARY, [10, 15], abandoned=frozenset({20})),
        StoreListing(MIRROR, [10, 15, 20], abandoned=frozenset({12})),
    ]
    assert resume_candidates(listings, saved_step=15)[:2] == [(15, PRIMARY), (15, MIRROR)]
    assert (20, MIRROR) not in resume_candidates(listings, saved_step=15)


def test_a_mirror_step_newer_than_the_primarys_newest_and_the_record_is_no_candidate():
    # The primary pruned the old branch's 20 (ABANDONED by a rollback to 10) at the new branch's save of 15; the
    # mirror missed both the rollback and that save.
    listings = [StoreListing(PRIMARY, [10, 15]), StoreListing(MIRROR, [10, 15, 20])]
    assert resume_candidates(listings, saved_step=15) == [(15, PRIMARY), (15, MIRROR), (10, PRIMARY), (10, MIRROR)]
    assert (20, MIRROR) not in resume_candidates(listings, saved_step=None)  # a new machine: no record
    # The record names 20: the primary lost it, and the mirror's copy is the run's.
    assert resume_candidates(listings, saved_step=20)[0] == (20, MIRROR)
    # An emptied primary and no record: the mirror is the only copy there is.
    assert resume_candidates([StoreListing(PRIMARY, []), StoreListing(MIRROR, [10, 20])], None)[0] == (20, MIRROR)


def test_a_mirror_holding_the_recorded_step_stands_in_for_an_unreadable_primary():
    listings = [StoreListing(PRIMARY, None, "refused"), StoreListing(MIRROR, [10, 20])]
    assert resume_candidates(listings, saved_step=20) == [(20, MIRROR), (10, MIRROR)]


def test_a_mirror_behind_the_recorded_step_does_not_stand_in_for_an_unreadable_primary():
    """Taking the mirror's step 10 would abandon steps 11 to 20, which the unreadable primary may hold."""
    listings = [StoreListing(PRIMARY, None, "refused"), StoreListing(MIRROR, [10])]
    with pytest.raises(StoreUnreadable, match=r"the readable stores' newest is step 10, and step 20, which"):
        resume_candidates(listings, saved_step=20)


def test_the_saved_record_round_trips_and_a_fresh_start_clears_it(tmp_path):
    assert SavedRecord.read(tmp_path) is None
    record = SavedRecord(step=20, policy_version=23, incarnation="abc", location="s3://ckpt/run/step-00000020/")
    record.write(tmp_path)
    assert SavedRecord.read(tmp_path) == record
    SavedRecord.clear(tmp_path)
    assert SavedRecord.read(tmp_path) is None


def test_a_damaged_saved_record_is_a_clear_error_naming_its_file(tmp_path):
    (tmp_path / SavedRecord.FILE).write_text('{"step": 20}')
    with pytest.raises(ValueError, match=r"checkpoint-saved.json is not a checkpoint record"):
        SavedRecord.read(tmp_path)


def test_a_live_step_of_a_lower_lease_epoch_than_an_older_one_is_a_fenced_out_writers():
    assert fenced_out([(1, 1), (2, 2), (3, 1), (4, 2), (5, None)]) == {3}
    assert fenced_out([(1, None), (2, 1), (3, 1)]) == set()  # writers without a lease, then one epoch
