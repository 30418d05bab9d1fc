"""What verify.json keeps for a baseline: versions, the redacted config, the first metrics and the conclusion."""

from __future__ import annotations

import json
import platform

import pytest

from services.cli.verify.check import Check
from services.cli.verify.checklist import write_record
from services.cli.verify.record import conclusion, first_run_metrics, library_versions
from services.common.config import load_config
from services.common.observe.records import metrics_rows
from tests.support.runs import config_file

pytestmark = pytest.mark.unit


def test_the_conclusion_names_each_failed_check_with_the_first_ones_evidence_or_what_was_skipped():
    checks = [Check("roles", "pass", "up"), Check("jumps", "fail", "kl_ref 0.01 -> 12"), Check("ranges", "fail", "x")]
    assert conclusion(checks) == (
        "failed: jumps, ranges (jumps: kl_ref 0.01 -> 12); fix before the deployment takes a run"
    )
    passed = [Check("roles", "pass", "up"), Check("remote-services", "skip", "none named")]
    assert conclusion(passed) == (
        "passed all 1 checks that ran; skipped: remote-services; keep this record as the baseline"
    )


def test_first_run_metrics_keep_the_baseline_keys_of_each_step_row_only():
    rows = metrics_rows(
        [{"step": 1, "loss": 0.1, "entropy": 2.0, "grad_norm": 3.0, "memory/host_rss_gb": 1.5, "time": 9.0}]
    )
    assert first_run_metrics(rows) == [{"step": 1, "loss": 0.1, "entropy": 2.0, "memory/host_rss_gb": 1.5}]


def test_library_versions_name_python_and_say_absent_for_a_library_not_installed(monkeypatch):
    import services.cli.verify.record as record

    monkeypatch.setattr(record, "LIBRARIES", ("pydantic", "no-such-library-rlpipe"))
    versions = library_versions()
    assert versions["python"] == platform.python_version()
    assert versions["no-such-library-rlpipe"] == "absent"
    assert versions["pydantic"][0].isdigit()


def test_the_record_holds_build_versions_the_redacted_config_first_metrics_and_conclusion(
    tmp_path, config_only_model, monkeypatch
):
    monkeypatch.setenv("RLPIPE_BUILD_VERSION", "1.2.3")  # as an image bakes them in
    monkeypatch.setenv("RLPIPE_BUILD_REVISION", "abc1234")
    config = config_file(tmp_path, config_only_model, alerts={"webhook_url": "https://hooks.example/T0KEN-in-the-path"})
    cfg = load_config(config)
    checks = [Check("roles", "pass", "up"), Check("jumps", "fail", "entropy 2 -> 30")]
    rows = metrics_rows([{"step": 1, "loss": 0.25, "entropy": 2.0, "time": 5.0}])
    as_json, as_md = write_record(cfg, config, checks, 12.0, rows=rows)
    record = json.loads(as_json.read_text())
    assert set(record) >= {"build", "libraries", "config", "first_run_metrics", "conclusion"}
    assert record["build"] == {"version": "1.2.3", "revision": "abc1234"}
    assert record["libraries"]["python"] == platform.python_version()
    assert record["config"]["alerts"]["webhook_url"] != cfg.alerts.webhook_url  # redacted
    assert "T0KEN" not in as_json.read_text() and "T0KEN" not in as_md.read_text()
    assert record["config"]["train"]["learning_rate"] == cfg.train.learning_rate
    assert record["first_run_metrics"] == [{"step": 1, "loss": 0.25, "entropy": 2.0}]
    assert record["conclusion"].startswith("failed: jumps (jumps: entropy 2 -> 30)")
    assert "Conclusion: failed: jumps" in as_md.read_text()
