"""The alert rule evaluator on hand-worked rows, and the webhook against a real local HTTP server."""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from services.common.config import AlertRule, default_alert_rules
from services.trainer.alerts import AlertEvaluator, Firing, post_webhook

pytestmark = pytest.mark.unit

HEALTHY_ROWS = Path(__file__).parent / "data" / "healthy_ppo_metrics.jsonl"


def rule(**fields) -> AlertRule:
    return AlertRule(**{"name": "r", "metric": "m", **fields})


def feed(evaluator: AlertEvaluator, values: list, start_step: int = 1, metric: str = "m") -> list[list[Firing]]:
    """One step row per value; returns what each row fired."""
    return [
        evaluator.observe({"step": start_step + i, metric: v}, now=float(start_step + i)) for i, v in enumerate(values)
    ]


def fired_at(results: list[list[Firing]]) -> list[int]:
    return [i for i, firings in enumerate(results) if firings]


def test_above_needs_the_whole_window_beyond_a_strict_threshold():
    evaluator = AlertEvaluator([rule(condition="above", threshold=1.0, window_steps=3)], cooldown_steps=0, now=0.0)
    # 1.0 is not above 1.0, so the run of three starts at index 3 and fires from index 5 on.
    results = feed(evaluator, [2.0, 2.0, 1.0, 1.5, 3.0, 1.1, 1.2, 0.5])
    assert fired_at(results) == [5, 6]
    firing = results[5][0]
    assert (firing.rule, firing.metric, firing.condition, firing.value, firing.threshold) == (
        "r",
        "m",
        "above",
        1.1,
        1.0,
    )
    assert firing.window == "3 steps" and firing.step == 6 and firing.time == 6.0
    assert (
        "m" in firing.message
        and "above 1" in firing.message
        and "3 steps" in firing.message
        and "1.1" in firing.message
    )


def test_below_and_rows_without_the_metric_do_not_count():
    evaluator = AlertEvaluator([rule(condition="below", threshold=0.1, window_steps=2)], cooldown_steps=0, now=0.0)
    assert evaluator.observe({"step": 1, "m": 0.05}, now=1.0) == []
    # An eval row and a status row in between neither fill nor break the window.
    assert evaluator.observe({"step": 1, "eval_accuracy": 0.5}, now=1.5) == []
    assert evaluator.observe({"services_down": 0}, now=1.6) == []
    [firing] = evaluator.observe({"step": 2, "m": 0.01}, now=2.0)
    assert firing.value == 0.01 and firing.condition == "below"
    assert feed(evaluator, [0.2], start_step=3) == [[]]


def test_nan_fires_on_nan_inf_and_non_numbers_but_not_on_finite_values():
    evaluator = AlertEvaluator(
        [rule(condition="nan", severity="critical", actions=["notify", "pause"])], cooldown_steps=0, now=0.0
    )
    results = feed(evaluator, [0.5, math.nan, 1.0, math.inf, None, "oops", -math.inf, 0.0])
    assert fired_at(results) == [1, 3, 4, 5, 6]
    firing = results[1][0]
    assert firing.actions == ["notify", "pause"] and firing.severity == "critical" and firing.window == "1 step"
    assert math.isnan(firing.value) and "m is nan" in firing.message
    assert results[3][0].value == math.inf and math.isnan(results[4][0].value)


def test_non_finite_values_never_count_as_beyond_a_threshold():
    evaluator = AlertEvaluator([rule(condition="above", threshold=0.0, window_steps=2)], cooldown_steps=0, now=0.0)
    assert fired_at(feed(evaluator, [1.0, math.nan, 1.0, None, 1.0, 1.0])) == [5]


def test_rises_by_compares_the_means_of_two_windows():
    evaluator = AlertEvaluator([rule(condition="rises_by", threshold=1.0, window_steps=2)], cooldown_steps=0, now=0.0)
    # Needs four values. [1, 1] -> [2, 2] is +100%: not more than 1.0. [1, 2] -> [2, 3.2] is +73%.
    # [2, 2] -> [3.2, 5] is +105%: fires.
    results = feed(evaluator, [1.0, 1.0, 2.0, 2.0, 3.2, 5.0])
    assert fired_at(results) == [5]
    firing = results[5][0]
    assert firing.value == pytest.approx(1.05) and firing.window == "2 steps"
    assert "rose by 105%" in firing.message and "100%" in firing.message


def test_falls_by_and_a_zero_baseline_never_fires():
    falls = AlertEvaluator([rule(condition="falls_by", threshold=0.5, window_steps=1)], cooldown_steps=0, now=0.0)
    # 4 -> 2 is -50% (not more than 0.5); 2 -> 0.9 is -55%; 0.9 -> -1 is -211%; and relative to a
    # negative baseline's size, -1 -> -2 is -100%.
    results = feed(falls, [4.0, 2.0, 0.9, 0.9, -1.0, -2.0])
    assert fired_at(results) == [2, 4, 5]
    assert results[2][0].value == pytest.approx(-0.55)
    rises = AlertEvaluator([rule(condition="rises_by", threshold=0.1, window_steps=2)], cooldown_steps=0, now=0.0)
    # A spread that starts at exactly 0 has no relative change to judge.
    assert fired_at(feed(rises, [0.0, 0.0, 0.3, 0.4])) == []


def test_absent_counts_from_creation_then_from_the_last_row_carrying_the_metric():
    evaluator = AlertEvaluator([rule(condition="absent", metric="step", window_s=60.0)], cooldown_steps=0, now=1000.0)
    assert evaluator.check_absent(now=1060.0) == []
    [firing] = evaluator.check_absent(now=1061.0)
    assert (firing.value, firing.threshold, firing.window, firing.step) == (61.0, 60.0, "60 s", None)
    assert "step" in firing.message and "61 s" in firing.message and "60 s" in firing.message
    assert evaluator.active == [firing]
    evaluator.observe({"step": 7, "loss": 0.1}, now=1100.0)
    assert evaluator.active == []
    assert evaluator.check_absent(now=1150.0) == []
    # Rows without the metric do not reset the clock.
    evaluator.observe({"services_down": 0}, now=1155.0)
    [firing] = evaluator.check_absent(now=1161.0)
    assert firing.step == 7 and firing.value == 61.0
    # After a pause (no metric was due) absence counts from the resume, for metrics seen or not.
    evaluator.restart_absence_clocks(now=2000.0)
    assert evaluator.check_absent(now=2060.0) == []
    assert [f.value for f in evaluator.check_absent(now=2061.0)] == [61.0]


def test_cooldown_counts_steps_including_rows_without_a_step():
    evaluator = AlertEvaluator(
        [rule(metric="services_down", condition="above", threshold=0.0)], cooldown_steps=3, now=0.0
    )
    [first] = evaluator.observe({"step": 10, "services_down": 1}, now=1.0)
    assert first.step == 10
    # Status rows carry no step: they take step 10, inside the cooldown.
    assert evaluator.observe({"services_down": 2}, now=2.0) == []
    assert evaluator.observe({"step": 12, "services_down": 1}, now=3.0) == []
    [again] = evaluator.observe({"services_down": 1, "step": 13}, now=4.0)
    assert again.step == 13 and again.value == 1.0


def test_cooldown_restarts_when_a_rollback_takes_the_step_back():
    evaluator = AlertEvaluator([rule(condition="above", threshold=0.0)], cooldown_steps=5, now=0.0)
    assert fired_at(feed(evaluator, [1.0], start_step=100)) == [0]
    # Back to step 90: quiet through 94 rather than firing on the first row after the rollback.
    assert fired_at(feed(evaluator, [1.0] * 7, start_step=90)) == [5]


def test_active_clears_when_a_later_row_finds_the_condition_false():
    evaluator = AlertEvaluator(
        [rule(name="hot", condition="above", threshold=1.0), rule(name="bad", condition="nan")],
        cooldown_steps=100,
        now=0.0,
    )
    feed(evaluator, [2.0])
    assert [f.rule for f in evaluator.active] == ["hot"]
    # A row without the metric judges nothing; the firing stays.
    evaluator.observe({"step": 2, "other": 5}, now=2.0)
    assert [f.rule for f in evaluator.active] == ["hot"]
    feed(evaluator, [math.nan], start_step=3)
    assert [f.rule for f in evaluator.active] == ["bad"]
    feed(evaluator, [0.5], start_step=4)
    assert evaluator.active == []
    # Within the cooldown the condition holds again without firing, and without becoming active.
    assert feed(evaluator, [3.0], start_step=5) == [[]]
    assert evaluator.active == []


def test_replace_rules_keeps_metric_history_and_drops_removed_rules():
    evaluator = AlertEvaluator([rule(name="old", condition="above", threshold=0.0)], cooldown_steps=50, now=0.0)
    feed(evaluator, [1.0, 2.0, 3.0, 4.0])
    assert [f.rule for f in evaluator.active] == ["old"]
    evaluator.replace_rules([rule(name="new", condition="rises_by", threshold=0.5, window_steps=2)], cooldown_steps=0)
    assert evaluator.active == [] and [r.name for r in evaluator.rules] == ["new"]
    # The history already holds [1, 2, 3, 4], so the first new row is judged at once:
    # [2, 3] -> [4, 3] is +40%, then [3, 4] -> [3, 9] is +71%.
    assert fired_at(feed(evaluator, [3.0, 9.0], start_step=5)) == [1]


def test_replace_rules_keeps_the_cooldown_of_a_rule_that_stays():
    evaluator = AlertEvaluator([rule(condition="above", threshold=0.0)], cooldown_steps=10, now=0.0)
    assert fired_at(feed(evaluator, [1.0, 1.0])) == [0]
    evaluator.replace_rules([rule(condition="above", threshold=0.5)], cooldown_steps=10)
    assert fired_at(feed(evaluator, [1.0] * 10, start_step=3)) == [8]


def test_default_rules_stay_quiet_on_a_healthy_run_and_catch_a_broken_one():
    rows = [json.loads(line) for line in HEALTHY_ROWS.read_text().splitlines()]
    assert len(rows) > 400
    healthy = AlertEvaluator(default_alert_rules(), cooldown_steps=20, now=rows[0]["time"])
    assert [f.message for row in rows for f in healthy.observe(row, now=row["time"])] == []

    broken = AlertEvaluator(default_alert_rules(), cooldown_steps=20, now=rows[0]["time"])
    fired = []
    for row in rows:
        if row["step"] >= 300 and "loss" in row:
            row = {**row, "loss": math.nan, "kl_ref": 2.0}
        fired += broken.observe(row, now=row["time"])
    fired += broken.observe({"step": rows[-1]["step"], "checkpoint_failed": 1}, now=rows[-1]["time"])
    assert {f.rule for f in fired} == {"nan_loss", "kl_too_high", "checkpoint_failures"}
    # The trainer's row for the next save that lands carries checkpoint_failed 0, which ends the alert.
    assert "checkpoint_failures" in {f.rule for f in broken.active}
    broken.observe({"step": rows[-1]["step"], "checkpoint_saved": 1, "checkpoint_failed": 0}, now=rows[-1]["time"])
    assert "checkpoint_failures" not in {f.rule for f in broken.active}


def strict_loads(body: bytes):
    """json.loads that refuses NaN and Infinity, as a JavaScript receiver would."""

    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(body, parse_constant=refuse)


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.put((self.path, self.headers["Content-Type"], strict_loads(body)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def receiver():
    server = HTTPServer(("127.0.0.1", 0), Receiver)
    server.received = queue.Queue()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.integration
def test_webhook_posts_the_firing_as_json(receiver):
    evaluator = AlertEvaluator([rule(condition="nan")], cooldown_steps=0, now=0.0)
    [firing] = evaluator.observe({"step": 3, "m": math.nan}, now=5.0)
    url = f"http://127.0.0.1:{receiver.server_port}/hooks/alerts"
    assert post_webhook(url, firing.as_dict()) is None
    path, content_type, payload = receiver.received.get(timeout=10)
    assert path == "/hooks/alerts" and content_type == "application/json"
    # The body is strict JSON: NaN arrives spelt out, everything else as as_dict() gives it.
    assert payload == {**firing.as_dict(), "value": "nan"} and payload["step"] == 3


@pytest.mark.integration
def test_webhook_failure_is_logged_not_raised(caplog):
    with HTTPServer(("127.0.0.1", 0), Receiver) as closed:
        port = closed.server_port  # bound then closed: nothing listens there
    with caplog.at_level(logging.WARNING, logger="rlpipe.alerts"):
        post_webhook(f"http://127.0.0.1:{port}/hooks/secret-token?key=secret", {"rule": "r"}, timeout_s=2.0)
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.02)
    [record] = caplog.records
    assert record.getMessage() == "alert_webhook_failed"
    assert record.fields["url"] == f"http://127.0.0.1:{port}"
    assert "Connection refused" in record.fields["error"]
