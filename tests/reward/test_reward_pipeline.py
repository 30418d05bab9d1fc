"""Whole runs scored by a reward model and by a remote reward service that is slowed, killed and restarted."""

from __future__ import annotations

import math
import time

import pytest

from services.common.model.reward_rules import exact_match
from services.common.observe import metrics as m
from services.trainer.intake.samples import GroupSample
from tests.support.runs import (
    config_file,
    metric_rows,
    run_pipeline,
    running_pipeline,
    service_events,
    wait_for,
)
from tests.support.servers import free_port, start_reward_server
from tests.support.telemetry import scrape, values

pytestmark = pytest.mark.e2e


@pytest.mark.e2e
def test_a_run_scored_by_the_reward_model_reports_each_part_in_its_step_rows(tiny_model, tiny_reward_model, tmp_path):
    reward_model, _ = tiny_reward_model
    config = config_file(
        tmp_path,
        tiny_model,
        "rm.yaml",
        run_id="rm",
        train={"total_steps": 3},
        reward={
            "functions": {"exact_match": 1.0},
            "model": {"path": str(reward_model), "weight": 0.5, "device": "cpu", "max_length": 32},
        },
    )
    done, rows = run_pipeline(config)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [row for row in rows if row.is_step]
    assert [row.step for row in steps] == [1, 2, 3]
    for row in steps:
        model, rule = row[m.REWARD_PART.of("model")], row[m.REWARD_PART.of("exact_match")]
        assert 0 < model < 1  # normalized scores
        assert 0 <= rule <= 1
        weighted = rule + 0.5 * model
        assert row[m.REWARD_MEAN] == pytest.approx(weighted, abs=1e-5)


TOTAL_STEPS = 14
BATCH = 8


@pytest.mark.e2e
def test_a_remote_reward_outage_loses_no_group_and_scores_none_falsely(tiny_model, tmp_path):
    """The reward server answers, then is slowed past the timeout, then killed, then restarted: every group
    is applied with exactly the score the server gives it, none is lost or dead-lettered, and the outage
    shows as error metrics and the reward_service_down alert."""
    port = free_port()
    config = config_file(
        tmp_path,
        tiny_model,
        "remote.yaml",
        run_id="remote",
        train={"total_steps": TOTAL_STEPS, "batch_size": BATCH},
        checkpoint={"save_every_steps": 5, "keep_last": 2},
        telemetry={"samples_keep_steps": 100},
        supervision={"stop_grace_s": 120},  # a loaded test machine can take longer than 20 s to stop a stage
        reward={
            "functions": {},
            "http": {
                "url": f"http://127.0.0.1:{port}/score",
                "timeout_s": 1.0,
                "retries": 1,
                "backoff_s": 0.2,
                "batch_size": 16,
            },
        },
    )
    run_dir = tmp_path / "runs" / "remote"
    steps = lambda: [r.step for r in metric_rows(run_dir) if r.is_step] if run_dir.exists() else []  # noqa: E731
    reward_events = lambda: service_events(run_dir, "reward-0")  # noqa: E731
    server = start_reward_server(port)
    try:
        with running_pipeline(config) as process:
            wait_for(lambda: len(steps()) >= 3, "three steps scored by the server", process, timeout=600)
            server.kill()
            server.wait()
            server = start_reward_server(port, "--delay-s", "2")  # slower than timeout_s: every request fails
            wait_for(
                lambda: any(e["event"] == "reward_request_failed" and e["kind"] == "timeout" for e in reward_events()),
                "a request timed out",
                process,
                timeout=120,
            )
            server.kill()
            server.wait()
            wait_for(
                lambda: any(e["event"] == "reward_service_down" for e in reward_events()),
                "the reward_service_down alert",
                process,
                timeout=120,
            )
            stalled_at = len(steps())
            # A fixed wait, since what it shows is that nothing happens: while the server is down nothing is scored
            # (so nothing is applied beyond what was in flight).
            time.sleep(5)
            metrics_url = next(e["metrics_url"] for e in reward_events() if e["event"] == "ready")
            samples = scrape(metrics_url)
            server = start_reward_server(port)
            output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-3000:]
    finally:
        server.kill()
        server.wait()

    # The outage as metrics: timeouts and refused connections counted, the breaker open while it lasted.
    assert sum(values(samples, "rlpipe_reward_http_errors_total", kind="timeout")) >= 1
    assert sum(values(samples, "rlpipe_reward_http_errors_total", kind="connection")) >= 1
    assert values(samples, "rlpipe_reward_http_breaker_state") == [2.0]
    assert sum(values(samples, "rlpipe_reward_http_latency_seconds_count", outcome="ok")) >= 3
    events = reward_events()
    down = [e for e in events if e["event"] == "reward_service_down"]
    assert len(down) == 1 and down[0]["alert"] is True
    assert [e for e in events if e["event"] == "reward_service_recovered"]
    assert not [e for e in events if e["event"] == "dead_letter"]

    # Every step applied; nothing lost or dead-lettered; training went on after the outage.
    rows = metric_rows(run_dir)
    step_rows = [r for r in rows if r.is_step]
    assert [r.step for r in step_rows] == list(range(1, TOTAL_STEPS + 1))
    assert stalled_at < TOTAL_STEPS
    assert sum((r.get(m.GROUPS_LOST) or 0) for r in rows) == 0
    assert sum((r.get(m.GROUPS_DEAD) or 0) for r in rows) == 0
    # Every applied completion carries the score the server computes for it: none was scored 0 for an outage.
    applied = [
        GroupSample.from_json(line)
        for path in sorted((run_dir / "samples").glob("step_*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert len(applied) == TOTAL_STEPS * BATCH
    assert len({group.group_id for group in applied}) == TOTAL_STEPS * BATCH
    for group in applied:
        for completion in group.completions:
            assert completion.reward == exact_match(completion.text, group.answer, completion.finish_reason), (
                group.group_id,
                completion.text,
                group.answer,
            )
    assert any(c.reward == 1.0 for g in applied for c in g.completions)  # the check can tell a 1 from a 0
    assert all(math.isfinite(r[m.REWARD_PART.of("http")]) for r in step_rows)
