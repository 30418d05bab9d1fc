"""Progress: the versions a resume or rollback disowned, and the one writer of each field."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import services
from services.trainer.progress import Adopted, ProcessState, Progress

pytestmark = pytest.mark.unit


def test_disowned_versions_are_the_inclusive_ranges_and_nothing_either_side():
    progress = Progress(version=12, abandoned_versions=[(3, 5), (9, 9)])
    assert [v for v in range(0, 13) if progress.disowned(v)] == [3, 4, 5, 9]


def test_nothing_is_disowned_before_a_resume_or_rollback_abandons_a_step():
    assert not any(Progress(version=4).disowned(v) for v in range(0, 5))


def _field_writes_outside_progress() -> list[str]:
    """Every statement under services/ that assigns a ``Progress`` field other than through its methods."""
    fields = {field.name for field in dataclasses.fields(Progress)}
    root = Path(services.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "trainer" / "progress.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                continue
            for target in targets:
                owner = target.value if isinstance(target, ast.Attribute) else None
                owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
                if owner_name == "progress" and target.attr in fields:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {target.attr}")
    return found


def test_no_module_assigns_a_progress_field_each_field_changes_only_through_the_method_named_for_its_fact():
    assert _field_writes_outside_progress() == []


def test_adopting_a_rollback_keeps_the_processs_dead_cursor_baseline_and_row_and_a_resume_takes_the_checkpoints():
    progress = Progress(step=9, version=9, dead_seq=7, saved_step=8, baseline_eval=0.25, last_row={"loss": 1.0})
    rollback = Adopted(step=4, version=10, applied_seq=40, incarnation="i", last_eval=0.5, abandoned_versions=[(5, 9)])
    progress.adopt(rollback)
    assert (progress.step, progress.saved_step, progress.version, progress.applied_seq) == (4, 4, 10, 40)
    assert (progress.dead_seq, progress.baseline_eval, progress.last_row) == (7, 0.25, {"loss": 1.0})
    assert progress.abandoned_versions == [(5, 9)] and progress.last_eval == 0.5
    resume = dataclasses.replace(rollback, process=ProcessState(dead_seq=3, baseline_eval=0.1, last_row={"loss": 2.0}))
    progress.adopt(resume)
    assert (progress.dead_seq, progress.baseline_eval, progress.last_row) == (3, 0.1, {"loss": 2.0})


def test_a_save_never_moves_the_saved_step_back():
    progress = Progress()
    progress.saved(6)
    progress.saved(4)  # an older upload that finished late
    assert progress.saved_step == 6


def test_a_step_saved_without_optimizer_state_is_not_saved_in_full_until_a_save_of_it_keeps_the_state():
    progress = Progress(step=6)
    progress.saved(6, whole=False)  # a periodic save under checkpoint.optimizer_every
    assert progress.saved_step == 6 and not progress.saved_in_full
    progress.saved(6)  # the save at a stop
    assert progress.saved_in_full
    progress.saved(6, whole=False)  # a late copy without it takes nothing back
    assert progress.saved_in_full
    progress.step = 7
    assert not progress.saved_in_full
