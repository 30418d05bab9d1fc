"""When a work queue's claim-checked body may go: what a stage decides after its ack or on finding it gone."""

import pytest

from services.common.transport.claim_lifecycle import (
    TRANSIENT_TAG,
    body_tags,
    deletable_after_ack,
    missing_body_is_stale,
)
from services.common.transport.streams import DEAD, EXPERIENCE, PROMPTS, ROLLOUTS, SCORED

pytestmark = pytest.mark.unit


def test_only_work_queue_bodies_carry_the_tag_the_lifecycle_rule_expires():
    assert [edge for edge in (PROMPTS, ROLLOUTS, SCORED, EXPERIENCE, DEAD) if body_tags(edge)] == [
        PROMPTS,
        ROLLOUTS,
        SCORED,
    ]
    assert body_tags(ROLLOUTS) == {TRANSIENT_TAG[0]: TRANSIENT_TAG[1]}


@pytest.mark.parametrize(
    ("headers", "gap_s", "deletable"),
    [
        ({"Nats-Msg-Id": "g1.inc.rollout"}, 1.0, True),
        ({"Nats-Msg-Id": "g1.inc.rollout"}, 29.9, True),
        ({"Nats-Msg-Id": "g1.inc.rollout"}, 30.0, False),  # half the ack wait without a beat: a twin is possible
        ({"Nats-Msg-Id": "reinjected.17"}, 1.0, False),  # its letter in DEAD still points at the body
        (None, 1.0, True),
    ],
)
def test_an_acked_body_is_deleted_unless_a_letter_or_a_twin_delivery_may_still_read_it(headers, gap_s, deletable):
    assert deletable_after_ack(headers, gap_s, ack_wait_s=60.0) is deletable


def test_a_missing_body_is_only_blamed_on_the_message_by_a_delivery_that_was_held_throughout():
    assert missing_body_is_stale(31.0, ack_wait_s=60.0)
    assert not missing_body_is_stale(5.0, ack_wait_s=60.0)
