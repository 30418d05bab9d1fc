"""The run report: PNG curves with events marked, the self-contained HTML page, and `rlpipe report`."""

from __future__ import annotations

import base64
import itertools
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import report
from services.cli.report import curve, event_steps, render_html, render_report, time_lines
from services.common.observe import metrics as m
from services.common.observe.records import event_records, metrics_rows
from tests.support.records import T0, report_section, write_jsonl

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KINDS = ("config_change", "alert", "rollback", "resume", "restart", "pause", "unpause", "stop")


def synthetic_metrics() -> list[dict]:
    """Steps 1..30, a rollback to 25, then 26..50 again: 55 step rows, 10 s apart; evals every 20
    steps; one checkpoint row; config version 2 from the second step 26 on."""
    rows = [{"time": T0, "step": 0, "eval_accuracy": 0.25}]
    for i, step in enumerate([*range(1, 31), *range(26, 51)]):
        clock = T0 + 10 * (i + 1)
        rows.append(
            {
                "time": clock,
                "step": step,
                "config_version": 2 if i >= 30 else 1,
                "reward_mean": step / 100,
                "reward_std": 0.1,
                "entropy": 1 - step / 100,
                "kl_ref": step / 1000,
                "response_length_mean": 10.0,
                "termination_rate": 0.9,
                "step_time_s": 1.0,
            }
        )
        if step % 20 == 0:
            rows.append({"time": clock + 1, "step": step, "eval_accuracy": 0.25 + step / 80})
        if step == 20:
            rows.append({"time": clock + 2, "step": step, "checkpoint_saved": 1})
    return rows


def synthetic_events() -> list[dict]:
    def first(step: int) -> float:
        """When the first pass wrote that step."""
        return T0 + 10 * step

    def second(step: int) -> float:
        """When the pass after the rollback to 25 wrote it again."""
        return T0 + 10 * (step + 5)

    return [
        {
            "time": first(5),
            "step": 5,
            "kind": "config_change",
            "message": "config version 2: train.lr=5e-05",
            "config_version": 2,
        },
        {
            "time": first(10) + 4,
            "step": None,
            "kind": "alert",
            "message": "kl_ref > 1 & <rising>",
            "rule": "kl_too_high",
        },
        {"time": first(30), "step": 30, "kind": "rollback", "message": "rolled back to step 25"},
        {"time": first(30) + 1, "step": 25, "kind": "resume", "message": "resumed from step 25"},
        {"time": second(40) - 3, "step": None, "kind": "restart", "message": "rollout-0 restarted (exit 1)"},
        {"time": second(36), "step": 36, "kind": "pause", "message": "paused by operator"},
        {"time": second(37), "step": 37, "kind": "unpause", "message": "resumed by operator"},
        {"time": second(50), "step": 50, "kind": "stop", "message": "stopped: total_steps reached"},
    ]


def make_run(tmp_path: Path, events: bool = True) -> Path:
    run_dir = tmp_path / "runs" / "demo"
    run_dir.mkdir(parents=True)
    write_jsonl(run_dir / "metrics.jsonl", synthetic_metrics())
    if events:
        write_jsonl(run_dir / "events.jsonl", synthetic_events())
    return run_dir


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_event_steps_use_their_own_step_or_the_nearest_row_in_time():
    rows = [
        {"time": 100.0, "step": 1},
        {"time": 110.0, "step": 2},
        {"time": 111.0, "eval_accuracy": 0.5},
        {"time": 130.0, "step": 3},
    ]
    events = [
        {"time": 500.0, "step": 7},
        {"time": 104.0, "step": None},  # nearer step 1 (4 s) than step 2 (6 s)
        {"time": 121.0},  # nearer step 3 (9 s) than step 2 (11 s); the stepless eval row does not count
        {"time": 50.0},
        {"time": 999.0},
        {"step": None},
    ]
    placed = event_steps(event_records(events), metrics_rows(rows))
    assert placed == [(7, False), (1, True), (3, True), (1, True), (3, True), (None, True)]
    assert event_steps(event_records([{"time": 1.0}]), []) == [(None, True)]


def test_png_is_a_full_size_image_with_the_events_drawn(tmp_path):
    run_dir = make_run(tmp_path)
    out = render_report(run_dir / "metrics.jsonl", tmp_path / "out" / "report.png")
    data = out.read_bytes()
    assert png_size(data) == (2000, 800)
    assert len(data) > 20_000
    # The default events file is the one beside the metrics; naming an empty one draws none.
    (tmp_path / "none.jsonl").write_text("")
    plain = render_report(run_dir / "metrics.jsonl", tmp_path / "plain.png", events_path=tmp_path / "none.jsonl")
    assert plain.read_bytes() != data


def test_html_embeds_the_png_and_lists_summary_versions_and_events(tmp_path):
    run_dir = make_run(tmp_path)
    out = render_html(run_dir)
    assert out == run_dir / "report.html"
    page = out.read_text()
    # Self-contained: the one image is inline and nothing is fetched from elsewhere.
    [encoded] = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert png_size(base64.b64decode(encoded)) == (2000, 800)
    text = page.replace(encoded, "")
    assert "<script" not in text and "http" not in text and "<link" not in text and "url(" not in text

    cells = re.findall(r"<td>(.*?)</td>", page)
    pairs = dict(itertools.pairwise(cells))
    assert pairs["step rows"] == "55" and pairs["last step"] == "50"
    assert pairs["wall time"] == "0:09:10"
    assert pairs["first eval accuracy (step 0)"] == "0.25"
    assert pairs["final eval accuracy (step 40)"] == "0.75"
    # The last 10% of 55 step rows are steps 46..50 of the second pass.
    assert pairs["reward_mean, mean of the last 5 steps"] == "0.48"
    assert pairs["step_time_s, mean of the last 5 steps"] == "1"

    versions = page.split("<h2>Config versions</h2>")[1].split("<h2>")[0]
    assert re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td>", versions) == [("1", "1"), ("2", "26")]

    events = page.split("<h2>Events</h2>")[1]
    rows = re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>", events)
    assert [kind for _, _, kind, _ in rows] == list(KINDS)
    assert [step for _, step, _, _ in rows] == ["5", "≈10", "30", "25", "≈40", "36", "37", "50"]
    assert rows[0][0] == "2023-11-14 22:14:10 UTC"
    assert rows[1][3] == "kl_ref &gt; 1 &amp; &lt;rising&gt;"
    for event in synthetic_events()[2:]:
        assert event["message"] in events
    assert "rule=kl_too_high" in events and "config_version=2" in events


def test_missing_events_file_still_renders_both(tmp_path):
    run_dir = make_run(tmp_path, events=False)
    png = render_report(run_dir / "metrics.jsonl", run_dir / "report.png")
    assert png_size(png.read_bytes()) == (2000, 800)
    page = render_html(run_dir, tmp_path / "elsewhere.html").read_text()
    assert "No events recorded." in page and "data:image/png;base64," in page


def test_a_runs_report_draws_its_curves_once_for_the_png_and_the_page_from_the_runs_metrics_file(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path)
    elsewhere = tmp_path / "metrics-elsewhere.jsonl"  # a run's metrics_path may lie outside its directory
    (run_dir / "metrics.jsonl").rename(elsewhere)
    drawn = []
    figure = report._figure
    monkeypatch.setattr(report, "_figure", lambda *args: drawn.append(args) or figure(*args))

    png, page = report.write_run_report(run_dir, elsewhere)

    assert (png, page) == (run_dir / "report.png", run_dir / "report.html")
    assert len(drawn) == 1
    html_text = page.read_text()
    [encoded] = re.findall(r"alt='training curves of demo' src='data:image/png;base64,([^']+)'", html_text)
    assert base64.b64decode(encoded) == png.read_bytes()
    assert "<td>step rows</td><td>55</td>" in html_text  # the summary read the metrics where they are


@pytest.mark.integration
def test_cli_writes_both_files_for_a_run_dir_or_a_run_id(tmp_path):
    run_dir = make_run(tmp_path)
    rlpipe = Path(sys.executable).parent / "rlpipe"
    by_dir = subprocess.run(
        [rlpipe, "report", str(run_dir)], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )
    assert by_dir.returncode == 0, by_dir.stderr
    assert by_dir.stdout.split() == [str(run_dir / "report.png"), str(run_dir / "report.html")]
    assert png_size((run_dir / "report.png").read_bytes()) == (2000, 800)
    assert "data:image/png;base64," in (run_dir / "report.html").read_text()

    (run_dir / "report.png").unlink()
    (run_dir / "report.html").unlink()
    by_id = subprocess.run(
        [rlpipe, "report", "demo"], capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path
    )
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout.split() == ["runs/demo/report.png", "runs/demo/report.html"]
    assert (run_dir / "report.png").is_file() and (run_dir / "report.html").is_file()

    missing = subprocess.run(
        [rlpipe, "report", "nope"], capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_curves_break_where_a_rollback_takes_the_step_back():
    rows = metrics_rows(
        [
            {"step": 1, "reward_mean": 1.0, "reward_std": 0.5},
            {"step": 2, "reward_mean": 2.0},
            {"step": 3, "reward_mean": "x"},
            {"step": 3, "reward_mean": math.nan},
            {"step": 3, "reward_mean": 3.0},
            {"step": 2, "reward_mean": 1.5, "reward_std": 0.1},
            {"reward_mean": 9.0},
        ]
    )
    xs, ys, band = curve(rows, m.REWARD_MEAN, m.REWARD_STD)
    # Non-numbers and rows without a step are left out; the step going from 3 back to 2 leaves a gap.
    assert xs[:3] == [1, 2, 3] and ys[:3] == [1.0, 2.0, 3.0] and xs[4:] == [2] and ys[4:] == [1.5]
    assert math.isnan(xs[3]) and math.isnan(ys[3])
    assert band[0] == 0.5 and math.isnan(band[1]) and band[4] == 0.1
    assert curve(rows, m.REWARD_MEAN, m.ENTROPY)[2] is None


def test_a_run_with_episodes_gets_an_agents_panel_and_its_summary_lists_the_agent_means(tmp_path):
    run_dir = make_run(tmp_path)
    rows = synthetic_metrics()
    for row in rows:
        if "reward_mean" in row:
            row |= {
                "agent/turns_mean": 3.0,
                "agent/tool_calls_mean": 2.0,
                "agent/tool_errors_mean": 0.5,
                "agent/env_seconds_mean": 0.25,
                "agent/outcome/done": 0.75,
                "agent/outcome/max_turns": 0.25,
                "dynamic_sampling/dropped_fraction": 0.4,
            }
    write_jsonl(run_dir / "metrics.jsonl", rows)
    page = render_html(run_dir).read_text()
    agents = page.split("<h2>Agents</h2>")[1].split("<h2>")[0]
    [encoded] = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", agents)
    assert png_size(base64.b64decode(encoded)) == (2500, 400)  # four panels and the outcomes, 5 x 4 inches each
    pairs = dict(itertools.pairwise(re.findall(r"<td>(.*?)</td>", page)))
    assert pairs["agent/turns_mean, mean of the last 5 steps"] == "3"
    assert pairs["dynamic_sampling/dropped_fraction, mean of the last 5 steps"] == "0.4"


def test_a_run_without_episodes_has_no_agents_panel(tmp_path):
    assert "<h2>Agents</h2>" not in render_html(make_run(tmp_path)).read_text()


def test_the_report_shows_the_mean_split_of_a_steps_wall_time_and_each_roles_time_share(tmp_path):
    split = {"time/wait_s": 0.2, "time/compute_s": 0.5, "time/publish_s": 0.05, "time/eval_s": 0.0}
    rows = [
        {"time": T0 + step, "step": step, "reward_mean": 0.1, **split, "time/bookkeeping_s": 0.05 * step}
        for step in (1, 3)
    ]
    rows[-1] |= {"share/rollout/busy": 0.7, "share/rollout/idle": 0.2, "share/rollout/blocked": 0.1}
    rows[-1] |= {"share/trainer/busy": 0.6, "share/trainer/idle": 0.35, "share/trainer/blocked": 0.05}
    assert time_lines(metrics_rows(rows)) == [
        (
            "wall s per step 0.850, by phase (mean of 2 steps)",
            "wait 0.200 (24%), compute 0.500 (59%), publish 0.050 (6%), eval 0.000 (0%), bookkeeping 0.100 (12%)",
        ),
        ("time share: rollout", "busy 70%, idle 20%, blocked 10%"),
        ("time share: trainer", "busy 60%, idle 35%, blocked 5%"),
    ]
    section = report_section(tmp_path / "run", rows, "Where the time goes")
    assert "<td>time share: rollout</td><td>busy 70%, idle 20%, blocked 10%</td>" in section


def test_a_run_without_the_time_split_has_no_time_lines():
    assert time_lines(metrics_rows(synthetic_metrics())) == []
