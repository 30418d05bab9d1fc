"""The typed readers of a run's record (services/common/observe/records.py): metrics rows read by declared metric,
events.jsonl lines as EventRecord, the trainer's done as RunDone."""

from __future__ import annotations

import json
import math

import pytest

from services.common.observe import metrics as m
from services.common.observe.events import Event
from services.common.observe.records import (
    EventRecord,
    MetricsRow,
    RunDone,
    read_events,
    read_jsonl,
    read_metrics,
    step_rows,
)

pytestmark = pytest.mark.unit


def test_a_row_reads_numbers_by_declared_metric_and_absent_or_non_numbers_as_none():
    row = MetricsRow({"step": 4, "reward_mean": 0.5, "entropy": math.nan, "kl_ref": "x", "critic_only": True})
    assert row.step == 4 and row.is_step and not row.is_eval
    assert row.get(m.REWARD_MEAN) == 0.5 and row[m.REWARD_MEAN] == 0.5
    assert math.isnan(row.get(m.ENTROPY)) and row.finite(m.ENTROPY) is None
    assert row.get(m.KL_REF) is None and m.KL_REF in row  # carried, but not a number
    assert row.get(m.CRITIC_ONLY) is None  # a bool is not a number of the row
    assert row.get(m.EVAL_ACCURACY) is None and m.EVAL_ACCURACY not in row
    with pytest.raises(KeyError, match="eval_accuracy"):
        row[m.EVAL_ACCURACY]
    assert isinstance(MetricsRow({"config_version": 2}).get(m.CONFIG_VERSION), int)  # an int stays an int


def test_a_row_gives_its_text_fields_its_family_members_and_every_number():
    alert = MetricsRow({"time": 9.5, "step": 3, "alert": "kl_too_high", "alert_severity": "warning"})
    assert alert.alert == "kl_too_high" and alert.text(m.ALERT_SEVERITY) == "warning" and alert.time == 9.5
    assert MetricsRow({"step": 3, "alert": 1}).alert is None
    row = MetricsRow({"step": 1, "reward/gsm8k/mean": 0.5, "reward/model/mean": 0.25, "reward_mean": 0.4})
    assert row.family(m.REWARD_PART) == {("gsm8k",): 0.5, ("model",): 0.25}
    assert dict(row.numbers()) == {"step": 1, "reward/gsm8k/mean": 0.5, "reward/model/mean": 0.25, "reward_mean": 0.4}


def test_step_rows_are_the_rows_with_a_step_and_the_batchs_reward(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 0, "eval_accuracy": 0.25},
        {"step": 1, "reward_mean": 0.5},
        {"step": 1, "checkpoint_saved": 1},
        {"reward_mean": 0.5},  # no step: not a step's row
        {"step": 2, "reward_mean": 0.6},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = read_metrics(path)
    assert [row.step for row in step_rows(rows)] == [1, 2]
    assert [row.step for row in rows if row.is_eval] == [0]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_read_jsonl_skips_a_half_written_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n[1, 2]\n{"step": 3, "reward')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_an_event_line_is_typed_with_its_kind_and_its_own_fields_apart(tmp_path):
    path = tmp_path / "events.jsonl"
    lines = [
        {"time": 5.0, "step": 7, "kind": "alert", "message": "kl high", "rule": "kl_too_high", "severity": "warning"},
        {"time": 6.0, "step": None, "kind": "from_a_newer_rlpipe", "message": "?"},
        {"kind": "done", "step": 9, "message": "9 steps done", "steps": 9, "baseline_accuracy": 0.25},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    alert, unknown, done = read_events(path)
    assert alert == EventRecord(Event.ALERT, "kl high", 5.0, 7, {"rule": "kl_too_high", "severity": "warning"})
    assert alert.rule == "kl_too_high" and unknown.rule is None
    assert unknown.kind == "from_a_newer_rlpipe" and unknown.step is None
    assert done.kind == Event.DONE and done.time is None
    finished = RunDone.of(done)
    assert finished == RunDone(steps=9, baseline_accuracy=0.25) and finished.accuracy_gain is None
    gained = RunDone.of(EventRecord.of({"kind": "done", "steps": 4, "baseline_accuracy": 0.25, "final_accuracy": 0.5}))
    assert gained.accuracy_gain == 0.25 and gained.stopped_by == ""
