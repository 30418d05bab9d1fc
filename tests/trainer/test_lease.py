"""The lease's decisions, without a broker: who may take it, at which epoch, and when a holder has lost it."""

import pytest

from services.trainer.lease import Lease, LeaseLost, LeaseRecord, Verdict, held_message, judge, successor

pytestmark = pytest.mark.unit


def test_a_lease_nobody_holds_or_whose_holder_let_it_expire_is_taken_at_once():
    assert judge(None, revision=0, seen_revision=None, now=50.0) is Verdict.TAKE
    lapsed = LeaseRecord("host:1", epoch=3, expires_at=100.0)
    assert judge(lapsed, revision=7, seen_revision=None, now=100.0) is Verdict.TAKE


def test_a_held_lease_is_waited_on_until_it_is_seen_renewed_which_refuses_or_it_expires_which_takes_it():
    held = LeaseRecord("host:1", epoch=3, expires_at=100.0)
    # A killed holder's lease looks like a live one's at first sight: wait rather than refuse its restart.
    assert judge(held, revision=7, seen_revision=None, now=90.0) is Verdict.WAIT
    assert judge(held, revision=7, seen_revision=7, now=95.0) is Verdict.WAIT  # not written since: maybe dead
    renewed = LeaseRecord("host:1", epoch=3, expires_at=105.0)
    assert judge(renewed, revision=8, seen_revision=7, now=96.0) is Verdict.REFUSE  # renewed: its holder lives
    assert judge(held, revision=7, seen_revision=7, now=100.0) is Verdict.TAKE  # never renewed: it was dead


def test_a_lease_whose_holder_is_known_dead_is_taken_at_once_and_no_other_holder_s_is():
    held = LeaseRecord("host:1", epoch=3, expires_at=100.0)
    # The launcher waited on host:1's process: its restart takes the lease without waiting out the TTL.
    assert judge(held, revision=7, seen_revision=None, now=90.0, reaped="host:1") is Verdict.TAKE
    # Another trainer took the lease since: it lives, and the restart is refused as any second trainer is.
    taken = LeaseRecord("host:9", epoch=4, expires_at=105.0)
    assert judge(taken, revision=8, seen_revision=None, now=90.0, reaped="host:1") is Verdict.WAIT
    assert judge(taken, revision=9, seen_revision=8, now=91.0, reaped="host:1") is Verdict.REFUSE


def test_a_taker_s_epoch_is_one_above_both_the_old_lease_s_and_the_store_s_fence():
    old = LeaseRecord("host:1", epoch=3, expires_at=100.0)
    assert successor(old, "host:2", floor=0, now=200.0, ttl_s=5.0) == LeaseRecord("host:2", 4, 205.0)
    # The broker lost the bucket (no old lease) but the store remembers epoch 7: epochs still only grow.
    assert successor(None, "host:2", floor=7, now=200.0, ttl_s=5.0) == LeaseRecord("host:2", 8, 205.0)
    assert successor(old, "host:2", floor=9, now=200.0, ttl_s=5.0).epoch == 10


def test_the_refusal_names_the_run_the_holder_its_epoch_and_when_the_lease_expires():
    message = held_message(LeaseRecord("gpu-7:4242", epoch=2, expires_at=112.5), "r1", now=100.0)
    assert "run r1 already has a live trainer: gpu-7:4242 holds its lease (epoch 2, expires in 12.5s" in message


def test_a_lease_record_round_trips_through_its_stored_json():
    record = LeaseRecord("h:1", 5, 123.25)
    assert LeaseRecord.from_json(record.to_json()) == record


def test_a_holder_past_its_expiry_by_its_own_clock_has_lost_the_lease_before_any_renewal():
    now = [100.0]
    lease = Lease(kv=None, run_id="r", ttl_s=5.0, clock=lambda: now[0])
    lease.record = LeaseRecord(lease.holder, 1, expires_at=105.0)
    lease.check()  # within the lease: no error
    now[0] = 105.0
    with pytest.raises(LeaseLost, match=r"the lease of epoch 1 expired 0\.0s ago") as lost:
        lease.check()
    assert lost.value.taken_over is False


def test_a_lease_never_acquired_has_no_epoch_to_write_with():
    with pytest.raises(LeaseLost, match="never acquired"):
        _ = Lease(kv=None, run_id="r", ttl_s=5.0).epoch
