"""``events.jsonl`` rolls by size like ``metrics.jsonl`` while two processes (the launcher and the trainer) write it,
and every reader (the report, a follower, the alert drill's) still sees every event once, in order."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from services.cli.report import render_html
from services.common.observe.events import EventLog
from services.common.observe.logs import JsonlFollower, jsonl_parts, rolled_part
from services.common.observe.records import read_jsonl

pytestmark = pytest.mark.integration

MAX_BYTES = 600  # a few events a part: dozens of rolls while both writers go on
EVENTS_EACH = 150
WRITER = """
import sys, time
from pathlib import Path
from services.common.observe.events import EventLog

path, name, count, go = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
events = EventLog(path, max_bytes={max_bytes})
while not go.exists():  # both start writing together, so their writes and rolls interleave
    time.sleep(0.01)
for n in range(count):
    events.write("restart", f"{{name}} event {{n}}", step=n, writer=name, n=n)
"""


def test_two_processes_writing_events_roll_them_into_parts_without_losing_or_tearing_a_line(tmp_path):
    run_dir = tmp_path / "runs" / "test"
    path, go = run_dir / "events.jsonl", tmp_path / "go"
    run_dir.mkdir(parents=True)
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER.format(max_bytes=MAX_BYTES), str(path), name, str(EVENTS_EACH), str(go)]
        )
        for name in ("launcher", "trainer")
    ]
    follower = JsonlFollower(path)
    followed = []
    go.touch()
    while any(writer.poll() is None for writer in writers):
        followed += follower.new_rows()  # reads while the writers roll the file under it
        time.sleep(0.005)
    followed += follower.new_rows()
    assert [writer.returncode for writer in writers] == [0, 0]

    parts = jsonl_parts(path)
    # Numbered without a gap (jsonl_parts stops at the first missing number) and none left over.
    assert sorted(run_dir.glob("events*.jsonl")) == sorted(parts)
    assert len(parts) > 10 and parts[0] == rolled_part(path, 1) and parts[-1] == path
    assert all(part.stat().st_size <= MAX_BYTES for part in parts)
    lines = [line for part in parts for line in part.read_text().splitlines()]
    rows = [json.loads(line) for line in lines]  # a torn or interleaved line would not parse
    assert len(rows) == 2 * EVENTS_EACH
    for name in ("launcher", "trainer"):
        # Each writer's events in the order it wrote them, across the parts: none lost, none twice.
        assert [row["n"] for row in rows if row["writer"] == name] == list(range(EVENTS_EACH))
    assert read_jsonl(path) == rows
    assert followed == rows

    report = render_html(run_dir).read_text()
    assert all(f"{name} event {n}<" in report for name in ("launcher", "trainer") for n in range(EVENTS_EACH))


@pytest.mark.unit
def test_a_follower_skipped_to_the_end_reads_only_later_events_across_a_roll(tmp_path):
    path = tmp_path / "events.jsonl"
    events = EventLog(path, max_bytes=MAX_BYTES)
    for n in range(10):
        events.write("alert", f"before {n}", step=n)
    follower = JsonlFollower(path).skip_to_end()  # as the alert drill starts
    for n in range(20):
        events.write("alert", f"after {n}", step=n)
    assert len(jsonl_parts(path)) > 3
    assert [row["message"] for row in follower.new_rows()] == [f"after {n}" for n in range(20)]
    # Nothing written yet: the follower then reads the whole record once it appears.
    later = tmp_path / "later.jsonl"
    follower = JsonlFollower(later).skip_to_end()
    EventLog(later).write("stop", "first")
    assert [row["message"] for row in follower.new_rows()] == ["first"]
