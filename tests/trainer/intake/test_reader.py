"""The group ledger: each fed group gets one fate, repeats are refused, slots are reconciled."""

import numpy as np
import pytest

from services.common.transport.messages import ExperienceGroup
from services.trainer.intake.ledger import Fate, GroupLedger
from services.trainer.intake.reader import token_id_problem, unusable
from services.trainer.progress import Progress
from tests.support.messages import completion, experience_group

pytestmark = pytest.mark.unit


def test_a_group_is_applied_once_and_every_later_delivery_of_it_is_refused():
    ledger = GroupLedger()
    ledger.fed("e0-i0", now=0.0)
    assert ledger.arrived("e0-i0")
    assert ledger.settle(["e0-i0"], step=1, fate=Fate.APPLIED) == ["e0-i0"]
    # The same group again: a feed after the duplicate window, a compute repeated past it.
    assert not ledger.arrived("e0-i0")
    assert not ledger.arrived("e0-i0")
    assert ledger.repeats == 2
    assert ledger.settle(["e0-i0"], step=2, fate=Fate.APPLIED) == []
    assert ledger.counts[Fate.APPLIED] == 1


def test_a_group_read_but_not_yet_applied_may_be_read_again_after_a_dropped_batch():
    ledger = GroupLedger()
    ledger.fed("e0-i3", now=0.0)
    assert ledger.arrived("e0-i3")  # read into a batch that an operator command then dropped
    assert ledger.arrived("e0-i3")  # re-read from the last applied sequence: still usable
    assert ledger.repeats == 0


def test_a_checkpoint_lists_groups_read_but_not_yet_applied_with_those_in_flight():
    ledger = GroupLedger()
    for group_id in ("e0-i1", "e0-i2", "e0-i3"):
        ledger.fed(group_id, now=0.0)
    assert ledger.arrived("e0-i2")  # in the batch being collected when the trainer saves (a stop, say)
    assert list(ledger.in_flight) == ["e0-i1", "e0-i3"]  # its slot is free: the pipeline is done with it
    assert ledger.unsettled() == ["e0-i1", "e0-i2", "e0-i3"]
    assert ledger.known("e0-i2")
    assert ledger.settle(["e0-i2"], step=5, fate=Fate.APPLIED) == ["e0-i2"]
    assert ledger.unsettled() == ["e0-i1", "e0-i3"]
    # Resumed from such a checkpoint, every unsettled group is in flight again (the read one comes back from
    # EXPERIENCE, past the checkpoint's sequence).
    resumed = GroupLedger()
    resumed.restore(["e0-i1", "e0-i2", "e0-i3"], applied=[], dead=[], reinjected=[], step=4, now=0.0)
    assert resumed.unsettled() == ["e0-i1", "e0-i2", "e0-i3"] and resumed.read == set()


def test_a_dead_lettered_group_frees_its_slot_and_is_never_fed_again():
    ledger = GroupLedger()
    ledger.fed("e0-i1", now=0.0)
    assert ledger.settle(["e0-i1"], step=4, fate=Fate.DEAD) == ["e0-i1"]
    assert ledger.in_flight == {}
    assert ledger.known("e0-i1")  # the feeder skips it after a resume
    assert not ledger.arrived("e0-i1")  # a late copy that made it through anyway is not applied


def test_only_groups_past_the_bound_that_a_later_group_overtook_are_overdue():
    ledger = GroupLedger()
    ledger.fed("old", now=0.0)
    ledger.fed("stuck", now=0.0)
    ledger.fed("young", now=50.0)
    # Nothing came back yet (a slow start, a role down): that is a stall, not lost groups.
    assert ledger.overdue(now=100.0, max_age_s=60.0) == []
    ledger.fed("newest", now=60.0)
    assert ledger.arrived("newest")
    assert ledger.overdue(now=100.0, max_age_s=60.0) == ["old", "stuck"]
    assert ledger.settle(ledger.overdue(now=100.0, max_age_s=60.0), step=7, fate=Fate.LOST) == ["old", "stuck"]
    assert list(ledger.in_flight) == ["young"]
    assert not ledger.arrived("old")  # a lost group that shows up after all is not applied a second time


def test_the_ledger_forgets_fates_older_than_the_oldest_kept_checkpoint_but_keeps_refusing_their_copies():
    ledger = GroupLedger()
    for group_id in ("e0-i0", "e0-i1", "e0-i2", "e0-i3", "e0-i4"):
        ledger.fed(group_id, now=0.0)
        assert ledger.arrived(group_id)
    ledger.settle(["e0-i0"], step=10, fate=Fate.APPLIED)
    ledger.settle(["e0-i1"], step=10, fate=Fate.DEAD)
    ledger.settle(["e0-i2"], step=20, fate=Fate.DROPPED)
    ledger.settle(["e0-i4"], step=20, fate=Fate.APPLIED)  # e0-i3 still has no fate: the watermark stops below it
    ledger.forget_through(30)  # the oldest kept checkpoint is step 30
    assert ledger.watermark() == "e0-i2"
    # Dead fates stay for a re-inject; e0-i4 is above the watermark, so only its entry refuses it.
    assert sorted(ledger.settled) == ["e0-i1", "e0-i4"]
    assert not ledger.arrived("e0-i0") and not ledger.arrived("e0-i2") and not ledger.arrived("e0-i4")
    assert ledger.repeats == 3
    assert ledger.known("e0-i0")  # and a resumed feeder would not feed it again
    assert ledger.arrived("e0-i3")  # read again after a dropped batch: still without a fate, still usable


def test_a_fate_settled_at_the_oldest_kept_step_is_kept_for_a_rollback_to_it():
    ledger = GroupLedger()
    ledger.fed("e0-i0", now=0.0)
    ledger.settle(["e0-i0"], step=20, fate=Fate.LOST)  # written off after step 20 was saved
    ledger.forget_through(20)
    assert ledger.fate("e0-i0") == Fate.LOST


def test_a_checkpoint_keeps_the_watermark_and_only_the_fates_above_it_and_a_resume_refuses_what_it_covers():
    ledger = GroupLedger()
    for group_id in ("e0-i0", "e0-i1", "e0-i2", "e1-i0"):
        ledger.fed(group_id, now=0.0)
    ledger.settle(["e0-i0", "e0-i2"], step=1, fate=Fate.APPLIED)
    ledger.settle(["e0-i1"], step=1, fate=Fate.DEAD)
    ledger.advance()
    assert ledger.watermark() == "e0-i2" and ledger.exceptions() == ["e0-i1"]
    ledger.settle(["e1-i0"], step=2, fate=Fate.DROPPED)  # above the watermark until the next advance
    assert ledger.exceptions() == ["e0-i1", "e1-i0"]

    resumed = GroupLedger()
    resumed.restore([], ledger.exceptions(), ledger.dead(), [], step=2, now=0.0, settled_through=ledger.watermark())
    assert [g for g in ("e0-i0", "e0-i1", "e0-i2", "e1-i0", "e1-i1") if resumed.arrived(g)] == ["e1-i1"]
    assert resumed.reopen("e0-i1", now=1.0)  # dead, kept by name: a re-inject still reopens it
    assert not resumed.reopen("e0-i0", now=1.0)  # applied, known only by the watermark: never reopened
    assert resumed.arrived("e0-i1")  # the reopened copy below the watermark is taken once
    assert resumed.settle(["e0-i1"], step=3, fate=Fate.APPLIED) == ["e0-i1"]
    assert not resumed.arrived("e0-i1")


def test_the_watermark_waits_below_a_group_without_a_fate_and_ignores_ids_of_another_shape():
    ledger = GroupLedger()
    for group_id in ("e0-i5", "e0-i7", "e0-i9", "odd"):
        ledger.fed(group_id, now=0.0)
    ledger.settle(["e0-i5", "e0-i9", "odd"], step=1, fate=Fate.APPLIED)
    ledger.advance()
    assert ledger.watermark() == "e0-i5"  # e0-i7 is in flight; the positions in between were never fed
    assert ledger.arrived("e0-i7")
    ledger.advance()
    assert ledger.watermark() == "e0-i5"  # read, but not yet applied: still no fate
    ledger.settle(["e0-i7"], step=2, fate=Fate.APPLIED)
    ledger.advance()
    assert ledger.watermark() == "e0-i9" and not ledger.covered("odd") and ledger.fate("odd") == Fate.APPLIED


def test_restore_adopts_a_checkpoints_in_flight_groups_and_settled_ids_and_keeps_the_dead_ones_dead():
    ledger = GroupLedger()
    ledger.fed("from-before-the-crash", now=0.0)
    ledger.restore(in_flight=["x", "y"], applied=["a", "b", "c"], dead=["c"], reinjected=["S:3"], step=5, now=100.0)
    assert {g: f.fed_at for g, f in ledger.in_flight.items()} == {"x": 100.0, "y": 100.0}
    assert {g: (s.step, s.fate) for g, s in ledger.settled.items()} == {
        "a": (5, Fate.APPLIED),
        "b": (5, Fate.APPLIED),
        "c": (5, Fate.DEAD),
    }
    assert ledger.dead() == ["c"] and ledger.reinjected == {"S:3"}
    assert ledger.reopen("c", now=101.0)  # a re-inject after the resume still gives it its second chance


def test_a_reopened_dead_group_is_in_flight_again_fed_last_and_its_copy_is_applied_once():
    ledger = GroupLedger()
    ledger.fed("e0-i0", now=0.0)
    ledger.fed("e0-i1", now=0.0)
    ledger.settle(["e0-i0"], step=2, fate=Fate.DEAD)
    assert ledger.reopen("e0-i0", now=50.0)
    assert ledger.fate("e0-i0") is None and ledger.dead() == []
    assert ledger.in_flight["e0-i0"].fed_at == 50.0
    assert ledger.in_flight["e0-i0"].serial > ledger.in_flight["e0-i1"].serial  # e0-i1 coming back overtakes nothing
    assert ledger.arrived("e0-i0")
    assert ledger.settle(["e0-i0"], step=3, fate=Fate.APPLIED) == ["e0-i0"]
    assert not ledger.arrived("e0-i0")  # a second copy (a second re-inject past the duplicate window) is refused
    assert not ledger.reopen("e0-i0", now=60.0)  # and its record reopens nothing: applied is final
    assert ledger.fate("e0-i0") == Fate.APPLIED and ledger.repeats == 1
    # Counted once dead and once applied, and once reopened, so the fates still add up to what was fed.
    assert (ledger.counts[Fate.DEAD], ledger.counts[Fate.APPLIED], ledger.reopened) == (1, 1, 1)


def test_a_dead_group_or_one_without_a_fate_reopens_and_no_other():
    ledger = GroupLedger()
    ledger.settle(["forgotten"], step=1, fate=Fate.DEAD)
    ledger.forget_through(1)  # no kept checkpoint goes back to step 1
    ledger.settle(["applied"], step=2, fate=Fate.APPLIED)
    ledger.settle(["dropped"], step=2, fate=Fate.DROPPED)
    ledger.settle(["lost"], step=2, fate=Fate.LOST)
    ledger.fed("flying", now=0.0)
    ledger.fed("read", now=0.0)
    assert ledger.arrived("read")
    candidates = ("applied", "dropped", "lost", "flying", "read", "forgotten", "never-fed")
    assert [g for g in candidates if ledger.reopen(g, now=1.0)] == ["forgotten", "never-fed"]
    assert {g: s.fate for g, s in ledger.settled.items()} == {
        "applied": Fate.APPLIED,
        "dropped": Fate.DROPPED,
        "lost": Fate.LOST,
    }
    assert list(ledger.in_flight) == ["flying", "forgotten", "never-fed"] and ledger.read == {"read"}


def experience_with(prompt_ids: np.ndarray, token_ids: np.ndarray) -> ExperienceGroup:
    return experience_group("g", [1.0], completions=[completion(token_ids, 0.0, text="2")], prompt_ids=prompt_ids)


def test_token_ids_must_be_integers_inside_the_models_vocabulary():
    ids = np.asarray([0, 7, 9], dtype=np.int64)
    assert token_id_problem(experience_with(ids, ids.astype(np.int32)), vocab_size=10) is None
    assert token_id_problem(experience_with(ids, np.zeros(0, np.int64)), vocab_size=10) is None  # stopped at once
    assert token_id_problem(experience_with(ids, ids.astype(np.float32)), vocab_size=10) == (
        "completion 0 token_ids are float32, not integers"
    )
    assert token_id_problem(experience_with(ids.astype(np.float64), ids), vocab_size=10) == (
        "prompt_ids are float64, not integers"
    )
    assert token_id_problem(experience_with(ids, np.asarray([3, 10])), vocab_size=10) == (
        "completion 0 token_ids range over 3..10, outside the model's vocabulary 0..9"
    )
    assert token_id_problem(experience_with(np.asarray([-1, 2]), ids), vocab_size=10) == (
        "prompt_ids range over -1..2, outside the model's vocabulary 0..9"
    )


def group_of_versions(policy_version: int, *token_versions: list[int] | None) -> ExperienceGroup:
    """A group made at ``policy_version`` whose completions' tokens came from ``token_versions`` (None: no
    per-token versions, every token the group's; [] a completion that stopped before its first token)."""
    completions = [
        completion(
            np.zeros(len(versions) if versions is not None else 2, np.int32),
            0.0,
            text="2",
            finish_reason="length",
            token_versions=np.asarray(versions, np.int32) if versions is not None else None,
        )
        for versions in token_versions
    ]
    rewards = [1.0] * len(completions)
    return experience_group("g", rewards, completions=completions, prompt_ids=[1, 1], policy_version=policy_version)


def test_a_group_is_as_stale_as_its_oldest_token_and_without_per_token_versions_as_its_own_version():
    progress = Progress(version=10)
    # Finished at version 9, but its first tokens were sampled at 6: four versions behind, past a bound of 3.
    assert unusable(group_of_versions(9, [6, 7, 9], [9, 9]), progress, max_staleness=3)
    assert not unusable(group_of_versions(9, [7, 7, 9], [9, 9]), progress, max_staleness=3)
    assert not unusable(group_of_versions(9, [6, 7, 9], [9, 9]), progress, max_staleness=None)
    assert unusable(group_of_versions(6, None, None), progress, max_staleness=3)  # schema 1: the group's version
    assert not unusable(group_of_versions(7, None, []), progress, max_staleness=3)  # an empty completion is no older


def test_a_group_one_of_whose_tokens_a_disowned_version_sampled_is_dropped():
    progress = Progress(version=10, abandoned_versions=[(4, 5)])
    assert unusable(group_of_versions(8, [5, 8], [8, 8]), progress, max_staleness=None)
    assert not unusable(group_of_versions(8, [6, 8], [8, 8]), progress, max_staleness=None)
    assert unusable(group_of_versions(5, None), progress, max_staleness=None)


def test_rewind_keeps_dead_and_lost_groups_and_what_is_in_flight_but_forgets_later_applications():
    ledger = GroupLedger()
    ledger.settle(["a"], step=1, fate=Fate.APPLIED)
    ledger.settle(["b"], step=3, fate=Fate.APPLIED)  # applied by a step the rollback abandons
    ledger.settle(["dead"], step=3, fate=Fate.DEAD)
    ledger.settle(["lost"], step=3, fate=Fate.LOST)
    ledger.fed("flying", now=0.0)
    assert ledger.rewind(applied=["a"], step=2, now=5.0) == ["b"]
    assert sorted(ledger.settled) == ["a", "dead", "lost"]
    assert ledger.arrived("b")  # re-read after the rollback: applied again in the new branch
    assert "flying" in ledger.in_flight


def test_a_rollback_keeps_a_group_reinjected_since_the_checkpoint_in_flight_and_not_settled_as_well():
    """The checkpoint saw it dead; an operator re-injected it after: it is in flight, with one fate to come."""
    ledger = GroupLedger()
    ledger.settle(["dead"], step=1, fate=Fate.DEAD)
    checkpoint_settled = ledger.exceptions()  # what a checkpoint of step 1 keeps beside its watermark
    assert ledger.reopen("dead", now=2.0)
    assert ledger.rewind(checkpoint_settled, step=1, now=5.0) == []
    assert "dead" in ledger.in_flight and "dead" not in ledger.settled


def test_a_group_whose_fate_a_rollback_undoes_is_in_flight_again_and_written_off_when_its_message_is_gone():
    """Rolled back past the purge, a group applied after the checkpoint is not in EXPERIENCE any more: it used to
    be left with no fate at all, neither settled nor in flight. Now it is in flight, and overdue (to be written
    off as lost, unless it waits unread in EXPERIENCE) once the bound passes after the rollback."""
    ledger = GroupLedger()
    for group_id in ("e0-i0", "e0-i1", "e0-i2", "e0-i3", "e0-i4"):
        ledger.fed(group_id, now=0.0)
        if group_id != "e0-i4":
            assert ledger.arrived(group_id)
    ledger.settle(["e0-i0"], step=1, fate=Fate.APPLIED)
    ledger.advance()
    checkpoint_watermark, checkpoint_applied = ledger.watermark(), ledger.exceptions()  # step 1 is saved
    ledger.settle(["e0-i1"], step=2, fate=Fate.APPLIED)
    ledger.settle(["e0-i2"], step=2, fate=Fate.DROPPED)
    ledger.settle(["e0-i3"], step=2, fate=Fate.LOST)
    ledger.forget_through(2)
    assert ledger.rewind(checkpoint_applied, step=1, now=100.0, settled_through=checkpoint_watermark) == [
        "e0-i1",
        "e0-i2",
    ]
    # The fates under the ledger's own watermark stand (the checkpoint's, the lost e0-i3's); the groups the rollback
    # undid are in flight again below it.
    assert ledger.watermark() == "e0-i3" and not ledger.arrived("e0-i0")
    assert ledger.fate("e0-i3") == Fate.LOST  # a lost group stays lost: it is not lost twice
    assert ledger.unsettled() == ["e0-i1", "e0-i2", "e0-i4"]
    assert ledger.overdue(now=150.0, max_age_s=60.0) == []  # their clocks started at the rollback
    # Groups fed after them came back before the rollback: the pipeline is past them. e0-i4 waits for one that
    # was fed after it.
    assert ledger.overdue(now=200.0, max_age_s=60.0) == ["e0-i1", "e0-i2"]


def test_a_rollback_reopens_a_group_its_checkpoint_saw_dead_that_was_reinjected_and_applied_since():
    """The recovery simulation's seed 65: the checkpoint saw e0-i0 dead, an operator re-injected it and a step the
    rollback abandons applied it. It came back settled as the checkpoint's, so its copy was refused: no fate."""
    ledger = GroupLedger()
    ledger.fed("e0-i0", now=0.0)
    ledger.settle(["e0-i0"], step=1, fate=Fate.DEAD)
    checkpoint_dead, checkpoint_settled = ledger.dead(), ledger.exceptions()  # a checkpoint of step 1
    assert ledger.reopen("e0-i0", now=1.0) and ledger.arrived("e0-i0")
    ledger.settle(["e0-i0"], step=2, fate=Fate.APPLIED)
    assert ledger.rewind(checkpoint_settled, step=1, now=5.0, dead=checkpoint_dead) == ["e0-i0"]
    assert "e0-i0" not in ledger.settled and ledger.arrived("e0-i0")  # its copy, re-read, is applied anew


def test_a_dead_letter_of_another_copy_does_not_settle_again_a_group_whose_fate_is_under_the_watermark():
    """The recovery simulation's seed 450: settled and forgotten under the watermark, a group got a dead letter from
    a second copy of its prompt; settled again as dead, a re-inject reopened it and it was applied once more."""
    ledger = GroupLedger()
    ledger.fed("e0-i0", now=0.0)
    assert ledger.arrived("e0-i0")
    ledger.settle(["e0-i0"], step=1, fate=Fate.APPLIED)
    ledger.forget_through(2)
    assert ledger.watermark() == "e0-i0" and "e0-i0" not in ledger.settled
    assert ledger.settle(["e0-i0"], step=2, fate=Fate.DEAD) == []
    assert not ledger.reopen("e0-i0", now=3.0) and not ledger.arrived("e0-i0")


def test_the_groups_of_a_dropped_batch_are_in_flight_again_and_written_off_if_their_messages_are_gone():
    """The recovery simulation's seed 84: the broker lost messages the trainer had read into a batch it then
    dropped. Left read, their groups were neither re-read nor written off: they never got a fate."""
    ledger = GroupLedger()
    for group_id in ("e0-i0", "e0-i1"):
        ledger.fed(group_id, now=0.0)
    assert ledger.arrived("e0-i0")  # read into the batch being collected, which an interrupt drops
    ledger.unread(now=10.0)
    assert ledger.read == set() and ledger.unsettled() == ["e0-i0", "e0-i1"]
    assert ledger.arrived("e0-i1")  # a group fed after it came back: the pipeline is past e0-i0
    assert ledger.overdue(now=100.0, max_age_s=60.0) == ["e0-i0"]


def test_a_rollback_keeps_the_ledger_s_higher_watermark_so_a_lost_group_known_only_by_it_stays_refused():
    """The recovery simulation's seed 151 (with a resume before the rollback): the resumed ledger knew a lost group
    only by its watermark; the older checkpoint's lower one forgot it, and a late copy would have been applied."""
    ledger = GroupLedger()
    # Resumed from a checkpoint under whose watermark e0-i0 was lost.
    ledger.restore(in_flight=["e0-i1"], applied=[], dead=[], reinjected=[], step=5, now=0.0, settled_through="e0-i0")
    assert ledger.rewind([], step=0, now=1.0, settled_through="") == []
    assert ledger.watermark() == "e0-i0" and not ledger.arrived("e0-i0")


def test_a_restored_ledger_numbers_in_flight_groups_in_feeding_order_not_string_order():
    """e0-i2 was fed before e0-i10: a string sort gave e0-i10 the lower serial, so once e0-i9 came back, the
    younger e0-i10 counted as overtaken and could be written off as lost while the older e0-i2 was spared."""
    ledger = GroupLedger()
    ledger.restore(in_flight=["e0-i10", "e0-i2", "e1-i0", "e0-i9"], applied=[], dead=[], reinjected=[], step=5, now=0.0)
    assert {g: f.serial for g, f in ledger.in_flight.items()} == {"e0-i2": 1, "e0-i9": 2, "e0-i10": 3, "e1-i0": 4}
    assert ledger.arrived("e0-i9")
    assert ledger.overdue(now=100.0, max_age_s=60.0) == ["e0-i2"]
    assert ledger.unsettled() == ["e0-i2", "e0-i9", "e0-i10", "e1-i0"]  # e0-i9 read, not yet applied
