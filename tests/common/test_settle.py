"""The stage's settle decision as a table: what happened to a message and its delivery count in, what to do out."""

import pytest

from services.common.transport.settle import (
    NAK_BACKOFF_CAP_S,
    Ack,
    DeadCause,
    DeadLetter,
    Nak,
    Outcome,
    settle,
    unsettled_letter,
)

pytestmark = pytest.mark.unit

TOO_LONG = ValueError("prompt of 9000 tokens exceeds max_model_len=4096")
HUNG = TimeoutError("compute of 1 message(s) took longer than nats.max_work_s=60s")


@pytest.mark.parametrize(
    ("outcome", "delivered", "max_deliver", "error", "expected"),
    [
        # Published downstream: acked, on its first delivery or its last.
        (Outcome.COMPUTED, 1, 3, None, Ack()),
        (Outcome.COMPUTED, 3, 3, None, Ack()),
        # Undecodable: the message's own fault, dead at once with the decoder's words, whatever deliveries are left.
        (
            Outcome.UNDECODABLE,
            1,
            3,
            ValueError("invalid Prompt: group_id missing"),
            DeadLetter(DeadCause.UNDECODABLE, "invalid Prompt: group_id missing"),
        ),
        # A compute that raised: retried after 2**delivered seconds until the delivery that reaches max_deliver.
        (Outcome.FAILED, 1, 3, TOO_LONG, Nak(2.0)),
        (Outcome.FAILED, 2, 3, TOO_LONG, Nak(4.0)),
        (Outcome.FAILED, 3, 3, TOO_LONG, DeadLetter(DeadCause.MAX_DELIVER, f"failed 3 times, last: {TOO_LONG!r}")),
        (Outcome.FAILED, 1, 1, TOO_LONG, DeadLetter(DeadCause.MAX_DELIVER, f"failed 1 times, last: {TOO_LONG!r}")),
        # The backoff stops growing at the cap, however many deliveries are allowed.
        (Outcome.FAILED, 4, 10, TOO_LONG, Nak(16.0)),
        (Outcome.FAILED, 5, 10, TOO_LONG, Nak(NAK_BACKOFF_CAP_S)),
        (Outcome.FAILED, 9, 10, TOO_LONG, Nak(NAK_BACKOFF_CAP_S)),
        # Abandoned past max_work_s: the same retries, and a dead letter that says it timed out on every delivery.
        (Outcome.TIMED_OUT, 1, 3, HUNG, Nak(2.0)),
        (Outcome.TIMED_OUT, 2, 3, HUNG, Nak(4.0)),
        (Outcome.TIMED_OUT, 3, 3, HUNG, DeadLetter(DeadCause.TIMEOUT, f"timeout: {HUNG} on each of 3 deliveries")),
    ],
)
def test_a_message_is_acked_naked_with_backoff_or_dead_lettered_by_its_outcome_and_deliveries(
    outcome, delivered, max_deliver, error, expected
):
    assert settle(outcome, delivered, max_deliver, error) == expected


@pytest.mark.parametrize(
    ("delivered", "max_deliver", "expected"),
    [
        (1, 3, None),
        (3, 3, None),  # its last allowed delivery is still tried
        (
            4,
            3,
            DeadLetter(DeadCause.MAX_DELIVER, "delivered 4 times without an outcome: a reward crashed or hung on it"),
        ),
        (
            9,
            3,
            DeadLetter(DeadCause.MAX_DELIVER, "delivered 9 times without an outcome: a reward crashed or hung on it"),
        ),
    ],
)
def test_a_message_delivered_past_max_deliver_without_an_outcome_is_dead_before_it_is_tried_again(
    delivered, max_deliver, expected
):
    assert unsettled_letter(delivered, max_deliver, "reward") == expected


def test_each_decision_is_counted_under_the_stage_outcome_its_metric_names():
    # rlpipe_groups_processed_total{outcome}: ok | retry | dead.
    labels = {type(decision): decision.label for decision in (Ack(), Nak(1.0), DeadLetter(DeadCause.TIMEOUT, "x"))}
    assert labels == {Ack: "ok", Nak: "retry", DeadLetter: "dead"}
