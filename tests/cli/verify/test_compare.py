"""What changed between two verifications: versions, settings, checks and figures, and the history kept for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.verify.compare import HISTORY_DIR, Change, compare, keep_previous, newest_earlier, record_changes

pytestmark = pytest.mark.unit


def record(time: str = "2026-12-01T10:00:00Z", **changes) -> dict:
    base = {
        "time": time,
        "build": {"version": "0.1.0", "revision": "aaa"},
        "libraries": {"torch": "2.13.0", "vllm": "0.32.0"},
        "config": {"run_id": "r", "train": {"learning_rate": 1e-5, "kl": {"coef": 0.001}}, "admin": {"token": "***"}},
        "checks": [{"name": "roles", "status": "pass", "detail": ""}, {"name": "smoke-run", "status": "pass"}],
        "first_run_metrics": [
            {"step": 1, "step_time_s": 1.0, "reward_mean": 0.5},
            {"step": 2, "step_time_s": 1.2, "reward_mean": 0.6},
            {"step": 3, "step_time_s": 1.1, "reward_mean": 0.55},
        ],
    }
    return {**base, **changes}


def test_two_alike_records_have_no_change_and_figures_within_the_tolerance_are_noise():
    before = record()
    after = record(first_run_metrics=[{"step": 1, "step_time_s": 1.15, "reward_mean": 0.57}])
    assert compare(before, after) == []


def test_versions_settings_checks_and_figures_that_moved_are_each_named_with_before_and_after():
    before = record()
    after = record(
        build={"version": "0.2.0", "revision": "bbb"},
        libraries={"torch": "2.13.0", "vllm": "0.33.0", "peft": "0.18"},
        config={"run_id": "r", "train": {"learning_rate": 2e-5, "kl": {"coef": 0.001}}, "admin": {"token": "***"}},
        checks=[{"name": "roles", "status": "fail"}, {"name": "smoke-run", "status": "pass"}],
        first_run_metrics=[{"step": 1, "step_time_s": 2.2, "reward_mean": 0.55}],
    )
    assert compare(before, after) == [
        Change("version", "build.revision", "aaa", "bbb"),
        Change("version", "build.version", "0.1.0", "0.2.0"),
        Change("version", "peft", "(absent)", "0.18"),
        Change("version", "vllm", "0.32.0", "0.33.0"),
        Change("config", "train.learning_rate", 1e-5, 2e-5),
        Change("check", "roles", "pass", "fail"),
        Change("figure", "step_time_s", 1.1, 2.2),
    ]
    assert Change("figure", "step_time_s", 1.1, 2.2).line() == "figure step_time_s: 1.1 -> 2.2 (2.00x)"


def test_each_verification_keeps_the_one_it_replaces_and_the_newest_is_the_baseline(tmp_path: Path):
    as_json = tmp_path / "verify.json"
    assert keep_previous(as_json) is None and newest_earlier(as_json) is None
    for day in (1, 2, 3):
        kept = keep_previous(as_json)
        as_json.write_text(json.dumps(record(time=f"2026-12-0{day}T10:00:00Z")))
    assert kept == tmp_path / HISTORY_DIR / "verify-2026-12-02T100000Z.json"
    assert newest_earlier(as_json) == kept and not (tmp_path / "verify.json").samefile(kept)
    keep_previous(as_json, keep=2)
    assert sorted(p.name for p in (tmp_path / HISTORY_DIR).iterdir()) == [
        "verify-2026-12-02T100000Z.json",
        "verify-2026-12-03T100000Z.json",
    ]


def test_the_changes_go_into_the_new_records_json_and_markdown(tmp_path: Path):
    baseline, as_json, as_md = tmp_path / "old.json", tmp_path / "verify.json", tmp_path / "verify.md"
    baseline.write_text(json.dumps(record()))
    as_json.write_text(json.dumps(record(libraries={"torch": "2.14.0", "vllm": "0.32.0"})))
    as_md.write_text("# Verification\n")
    changes = record_changes(as_json, as_md, baseline)
    assert changes == [Change("version", "torch", "2.13.0", "2.14.0")]
    assert json.loads(as_json.read_text())["changes_since"] == {
        "record": str(baseline),
        "changes": [{"kind": "version", "name": "torch", "before": "2.13.0", "after": "2.14.0"}],
    }
    assert as_md.read_text().endswith(f"## Changes since {baseline}\n\n- version torch: 2.13.0 -> 2.14.0\n")
