"""The metrics contract (services/common/observe/metrics.py): every row key declared once, and what is derived from
it (the exported gauges, the trackers' names, docs/metrics.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.config import default_alert_rules
from services.common.observe import metrics as m
from services.common.observe import metrics_reference
from services.common.observe.metric_types import Kind
from services.common.observe.timeshare import StageActivity, StepPhase

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
REAL_RUN = ROOT / "tests" / "trainer" / "data" / "healthy_ppo_metrics.jsonl"  # rows a real PPO run wrote


def test_a_row_with_an_undeclared_key_fails_the_check_naming_every_such_key():
    m.check_row({"step": 3, "reward_mean": 0.5, "reward/gsm8k/mean": 0.25, "time/wait_s": 0.1})
    planted = {"step": 3, "reward_mean": 0.5, "reward_mean_typo": 0.5, "agent/outcome/exploded": 0.1}
    with pytest.raises(m.UndeclaredMetric, match=r"reward_mean_typo, agent/outcome/exploded$"):
        m.check_row(planted)


def test_the_rows_a_real_run_wrote_carry_only_declared_keys():
    rows = [json.loads(line) for line in REAL_RUN.read_text().splitlines()]
    assert len(rows) > 100
    for row in rows:
        m.check_row(row)


def test_a_familys_members_resolve_to_its_declaration_and_a_closed_family_takes_only_its_values():
    part = m.find("reward/gsm8k/mean")
    assert part == m.REWARD_PART.of("gsm8k") and part.kind == m.REWARD_PART.kind and not part.exported
    assert m.find("share/rollout-0/busy") == m.TIME_SHARE.of("rollout-0", "busy")
    assert m.TIME_SHARE.parts("share/rollout/idle") == ("rollout", "idle")
    assert m.find("agent/outcome/timeout").exported and m.find("agent/outcome/exploded") is None
    assert m.find("reward/a/b/mean") is None  # a placeholder is one segment
    with pytest.raises(ValueError, match="no member"):
        m.AGENT_OUTCOME.of("exploded")
    with pytest.raises(ValueError, match="no member"):
        m.TIME_SHARE.of("rollout")
    assert m.TIME_SPLIT.value(m.TIME_SPLIT.of("wait")) == "wait"


def test_the_exported_gauges_are_the_exported_declarations_with_each_closed_familys_members():
    keys = set(m.TRAINER_STEP_KEYS)
    assert len(keys) == len(m.TRAINER_STEP_KEYS)
    assert {f"time/{phase}_s" for phase in StepPhase} <= keys  # a new phase is declared and exported with it
    assert {f"agent/outcome/{outcome}" for outcome in m.EPISODE_OUTCOMES} <= keys
    assert {metric.key for metric in m.METRICS if metric.exported} <= keys
    assert not keys & {metric.key for metric in m.METRICS if not metric.exported}
    assert all(m.find(key).kind != Kind.TEXT for key in keys)
    assert m.TIME_SPLIT.of("wait").gauge_name == "rlpipe_trainer_time_wait_s"


def test_the_trackers_get_the_common_namespaces_and_no_two_keys_share_a_tracker_name():
    assert m.tracker_name("approx_kl") == "actor/ppo_kl"
    assert m.tracker_name("memory/peak_gb") == "memory/peak_gb"  # a namespace of its own is kept
    assert m.tracker_name("roles_stalled") == "trainer/roles_stalled"  # none of its own: under trainer/
    assert m.tracker_name("never_declared") == "trainer/never_declared"
    concrete = [*m.METRICS, *(member for family in m.FAMILIES for member in family.members())]
    names = [metric.tracker_name for metric in concrete if metric.kind not in (Kind.INDEX, Kind.TEXT)]
    assert len(names) == len(set(names))
    assert {"time", "step", "alert", "alert_severity", "error"} == m.NOT_METRICS


def test_every_default_alert_rule_judges_a_declared_metric():
    for rule in default_alert_rules():
        assert m.find(rule.metric) is not None, rule.name


def test_the_time_share_family_names_the_stages_activities():
    for activity in StageActivity:
        assert m.TIME_SHARE.parts(f"share/reward/{activity}") == ("reward", activity)


def test_the_checked_in_metrics_reference_is_what_the_contract_generates():
    checked_in = metrics_reference.section((ROOT / "docs" / "metrics.md").read_text())
    assert checked_in == metrics_reference.render(), "docs/metrics.md is stale: run `make metrics-reference`"


def test_the_reference_lists_every_declared_key_and_a_rewrite_keeps_the_prose_around_it(tmp_path):
    rendered = metrics_reference.render()
    assert all(f"| `{metric.key}` |" in rendered for metric in m.METRICS)
    assert all(f"| `{family.pattern}` |" in rendered for family in m.FAMILIES)
    assert "| `time/<phase>_s` | gauge | s | same | `rlpipe_trainer_time_<phase>_s` |" in rendered
    doc = tmp_path / "metrics.md"
    doc.write_text(f"# Before\n\n{metrics_reference.BEGIN}\nan old table\n{metrics_reference.END}\n\nAfter.\n")
    metrics_reference.rewrite(doc)
    assert doc.read_text() == f"# Before\n\n{rendered}\n\nAfter.\n"
    doc.write_text("# No markers\n")
    with pytest.raises(ValueError, match="no generated section"):
        metrics_reference.rewrite(doc)
