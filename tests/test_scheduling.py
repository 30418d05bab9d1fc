"""The order the integration and e2e tiers hand files to pytest-xdist workers (tests/conftest.py)."""

import pytest

from tests.conftest import LONGEST_FIRST, ROOT

pytestmark = pytest.mark.unit


def test_every_file_scheduled_first_exists_once():
    # A renamed or deleted file would silently fall back to collection order, and the long file to the end.
    assert [path for path in LONGEST_FIRST if not (ROOT / path).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
