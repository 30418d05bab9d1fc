"""Who wrote a DEAD message is told by its subject: each role's key may publish only to its own, and a letter is
trusted only for the stream its role reads (``dead_letters.forged``)."""

import pytest

from services.common.transport.dead_letters import forged
from services.common.transport.nats_auth import permissions
from services.common.transport.nats_connect import ROLES
from services.common.transport.streams import (
    DEAD,
    EXPERIENCE,
    H_GROUP,
    H_REINJECT_SENT,
    H_REINJECTED,
    H_STREAM,
    PROMPTS,
    READS,
    ROLLOUTS,
    SCORED,
    dead_role,
    dead_subject,
    stream_name,
    stream_subjects,
    subject,
)

pytestmark = pytest.mark.unit


def test_each_role_may_publish_to_dead_only_on_its_own_subject():
    for role in ROLES:
        dead = [s for s in permissions("r", role).publish if s.startswith(subject("r", DEAD))]
        assert dead == [dead_subject("r", role)], role


def test_the_dead_stream_takes_every_roles_subject_and_the_bare_one_of_an_older_build():
    assert stream_subjects("r", DEAD) == ["rlpipe.r.dead", "rlpipe.r.dead.>"]
    assert stream_subjects("r", EXPERIENCE) == ["rlpipe.r.experience"]
    assert dead_role("r", "rlpipe.r.dead.reward") == "reward" and dead_role("r", "rlpipe.r.dead") is None


def test_a_letter_counts_only_for_the_stream_its_role_reads():
    assert READS == {"rollout": PROMPTS, "reward": ROLLOUTS, "reference": SCORED, "trainer": EXPERIENCE}
    for role, edge in READS.items():
        assert forged("r", dead_subject("r", role), {H_GROUP: "g", H_STREAM: stream_name("r", edge)}) is None
    rollout_naming_experience = {H_GROUP: "g", H_STREAM: stream_name("r", EXPERIENCE)}
    why = forged("r", dead_subject("r", "rollout"), rollout_naming_experience)
    assert why is not None and "RLPIPE_r_EXPERIENCE" in why and "RLPIPE_r_PROMPTS" in why
    assert forged("r", dead_subject("r", "rollout"), {H_GROUP: "g"}) is not None  # no stream named at all
    # The operator writes records and notes, never letters.
    assert forged("r", dead_subject("r", "operator"), rollout_naming_experience) is not None


def test_re_inject_records_and_notes_count_only_from_the_operators_subject():
    for header in (H_REINJECTED, H_REINJECT_SENT):
        assert forged("r", dead_subject("r", "operator"), {header: "3", H_GROUP: "g"}) is None
        for role in READS:
            assert forged("r", dead_subject("r", role), {header: "3", H_GROUP: "g"}) is not None, role


def test_a_message_on_the_bare_subject_of_an_older_build_is_taken_at_its_word():
    assert forged("r", subject("r", DEAD), {H_GROUP: "g", H_STREAM: "anything"}) is None
    assert forged("r", subject("r", DEAD), {H_REINJECTED: "3"}) is None
