"""What the study's records turn into: the ranking behind `best`, the table, and the report with every status."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import optuna
import pytest

from services.tuner import records
from services.tuner.records import TrialEnd
from services.tuner.spec import TuneSpec

pytestmark = pytest.mark.unit

# (status, Optuna state, objective, constraints) of each trial, as the tuner tells them.
TRIALS = [
    ("complete", "COMPLETE", 0.30, [0.0]),
    ("complete", "COMPLETE", 0.90, [0.0, 2.0]),  # the best value, but an alert constraint failed: not a candidate
    ("oom", "COMPLETE", 0.95, [1.0]),
    ("pruned", "PRUNED", 0.10, [0.0]),
    ("failed", "FAIL", None, [0.0]),
    ("complete", "COMPLETE", 0.60, [0.0]),
    ("duplicate", "COMPLETE", 0.60, [0.0]),
]


@pytest.fixture
def study_and_spec(tmp_path: Path) -> tuple[optuna.Study, TuneSpec]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = TuneSpec(
        study="r",
        base_config=tmp_path / "unused.yaml",
        workdir=tmp_path,
        space={"train.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
    )
    study = optuna.create_study(direction="maximize")
    for i, (status, state, objective, constraints) in enumerate(TRIALS):
        trial = study.ask()
        trial.suggest_float("train.learning_rate", 1e-4, 1e-2, log=True)
        trial.report(0.05 * i, 10)
        end = TrialEnd(status=status, reason=status, objective=objective, constraints=constraints)
        trial.set_user_attr("end", asdict(end))
        if state == "COMPLETE":
            study.tell(trial, objective)
        else:
            study.tell(trial, state=optuna.trial.TrialState[state])
    return study, spec


def test_the_best_is_the_best_complete_feasible_trial_that_ran_itself(study_and_spec):
    study, spec = study_and_spec
    ranked = records.ranked(spec, records.records(study))
    assert [r.number for r in ranked] == [5, 0]  # not 1 (infeasible), 2 (oom), 6 (a copy of 5)


def test_the_table_lists_every_trial_with_its_status_and_marks_the_best(study_and_spec):
    from rich.console import Console

    study, spec = study_and_spec
    console = Console(width=200, record=True)
    console.print(records.status_table(spec, records.records(study)))
    text = console.export_text()
    for number, (status, *_) in enumerate(TRIALS):
        assert f"│ {number} │ {status}" in text
    assert "0.6 *" in text and text.count("*") == 2  # the title's legend and the best trial


def test_the_report_shows_failed_and_pruned_trials(study_and_spec, tmp_path):
    study, spec = study_and_spec
    page = records.render_report(spec, study, tmp_path / "report")
    names = sorted(p.name for p in page.parent.iterdir())
    assert names == [
        "history.png",
        "importances.png",
        "intermediate_values.png",
        "parallel_coordinates.png",
        "report.html",
    ]
    html = page.read_text()
    assert html.count("<tr><td>") == len(TRIALS)
    assert "<td>failed</td>" in html and "<td>pruned</td>" in html and "<td>oom</td>" in html
