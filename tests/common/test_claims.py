"""What a claim check may point at and declare: it comes from a message and is trusted with nothing."""

import pytest

from services.common.transport.claims import check_claim, claim_key_fault
from services.common.transport.messages import ClaimCheck, DecodeError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("key", "fault"),
    [
        ("run/claims/rollouts/g1.rollout-0123", None),
        ("", "not under the run's claim prefix"),
        ("/etc/passwd", "not under the run's claim prefix"),
        ("/run/claims/rollouts/g1", "not under the run's claim prefix"),
        ("other/claims/rollouts/g1", "not under the run's claim prefix"),
        ("run/claims/", "not a plain path"),
        ("run/claims/../../etc/passwd", "not a plain path"),
        ("run/claims/rollouts/./g1", "not a plain path"),
        ("run/claims/rollouts//g1", "not a plain path"),
        ("run/claims/rollouts/g1/", "not a plain path"),
        ("run/claims/rollouts\\..\\..\\x", "not a plain path"),
        ("run/claims/rollouts/g1\0", "not a plain path"),
    ],
)
def test_a_claim_key_must_be_a_plain_path_under_the_runs_claim_prefix(key, fault):
    found = claim_key_fault(key, "run")
    assert found is None if fault is None else fault in found


def test_a_claim_declaring_no_bytes_or_more_than_max_claim_bytes_is_the_messages_fault():
    claim = ClaimCheck(key="run/claims/rollouts/g1", size=1000, sha256="0" * 64)
    check_claim(claim, "run", max_bytes=1000)
    for size in (0, -1, 1001):
        with pytest.raises(DecodeError, match=rf"declares {size} bytes; allowed 1 to nats.max_claim_bytes=1000"):
            check_claim(claim.model_copy(update={"size": size}), "run", max_bytes=1000)
    with pytest.raises(DecodeError, match="not under the run's claim prefix"):
        check_claim(claim, "another-run", max_bytes=1000)
