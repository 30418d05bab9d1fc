"""Progress: the versions a resume or rollback disowned."""

from __future__ import annotations

import pytest

from services.trainer.progress import Progress

pytestmark = pytest.mark.unit


def test_disowned_versions_are_the_inclusive_ranges_and_nothing_either_side():
    progress = Progress(version=12, abandoned_versions=[(3, 5), (9, 9)])
    assert [v for v in range(0, 13) if progress.disowned(v)] == [3, 4, 5, 9]


def test_nothing_is_disowned_before_a_resume_or_rollback_abandons_a_step():
    assert not any(Progress(version=4).disowned(v) for v in range(0, 5))
