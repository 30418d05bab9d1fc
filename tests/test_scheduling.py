"""The order the integration and e2e tiers hand files to pytest-xdist workers (tests/support/scheduling.py)."""

import pytest

from tests.support.paths import ROOT
from tests.support.scheduling import LONGEST_FIRST, WAITING, scheduling_rank

pytestmark = pytest.mark.unit


def test_every_file_scheduled_first_exists_once():
    # A renamed or deleted file would silently fall back to collection order, and the long file to the end.
    scheduled = [*LONGEST_FIRST, *WAITING]
    assert [path for path in scheduled if not (ROOT / path).is_file()] == []
    assert len(set(scheduled)) == len(scheduled)


class Collected:
    """What scheduling_rank reads of a collected test: its node id and its tier marker."""

    def __init__(self, nodeid: str, tier: str):
        self.nodeid = nodeid
        self.tier = getattr(pytest.mark, tier).mark

    def iter_markers(self):
        return iter([self.tier])


def test_the_longest_files_go_first_then_the_waiting_ones_then_runs_then_integration_then_unit():
    items = [
        Collected("tests/common/test_claims.py::test_u", "unit"),
        Collected("tests/common/test_bus.py::test_a", "integration"),
        Collected(f"{WAITING[1]}::test_b", "integration"),
        Collected("tests/test_poison.py::test_c", "e2e"),
        Collected(f"{LONGEST_FIRST[1]}::test_d", "e2e"),
        Collected(f"{WAITING[0]}::test_e", "integration"),
        Collected(f"{LONGEST_FIRST[0]}::test_f", "e2e"),
        Collected(f"{LONGEST_FIRST[0]}::test_g", "integration"),
    ]
    ordered = [item.nodeid.rpartition("::")[2] for item in sorted(items, key=scheduling_rank)]
    assert ordered == ["test_f", "test_g", "test_d", "test_e", "test_b", "test_c", "test_a", "test_u"]
