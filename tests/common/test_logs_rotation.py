"""Service logs rotate by size and keep a bounded number of old files; `rlpipe run` writes them that way."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from services.cli.launch.children import Child
from services.common.observe.events import Event
from services.common.observe.logs import JsonlFollower, RotatingLog, jsonl_parts, log_event, rolled_part, setup_logging
from services.common.observe.records import read_jsonl
from services.trainer.responder import MetricsLog

pytestmark = pytest.mark.unit


def line(n: int) -> bytes:
    return f'{{"event": "tick", "n": "{n:03d}"}}\n'.encode()  # the same length for every n


LINE = len(line(0))


def test_a_log_past_its_size_rotates_and_keeps_only_the_newest_files(tmp_path):
    path = tmp_path / "reward-0.log"
    log = RotatingLog(path, max_bytes=2 * LINE + 1, keep=2)  # two lines per file
    for n in range(9):
        log.write(line(n))
    log.close()
    assert path.read_bytes() == line(8)
    assert (tmp_path / "reward-0.log.1").read_bytes() == line(6) + line(7)
    assert (tmp_path / "reward-0.log.2").read_bytes() == line(4) + line(5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reward-0.log", "reward-0.log.1", "reward-0.log.2"]
    assert log.rotated() == [tmp_path / "reward-0.log.2", tmp_path / "reward-0.log.1"]


def test_a_line_longer_than_the_limit_is_kept_whole(tmp_path):
    path = tmp_path / "x.log"
    log = RotatingLog(path, max_bytes=10, keep=1)
    log.write(line(1))
    log.write(line(2))
    log.close()
    assert path.read_bytes() == line(2) and (tmp_path / "x.log.1").read_bytes() == line(1)


def test_keep_zero_keeps_no_rotated_file_and_a_reopened_log_counts_what_is_there(tmp_path):
    path = tmp_path / "x.log"
    path.write_bytes(line(0))
    log = RotatingLog(path, max_bytes=LINE + 1, keep=0)
    log.write(line(1))  # two lines do not fit: the earlier run's line goes
    log.close()
    assert [p.name for p in tmp_path.iterdir()] == ["x.log"] and path.read_bytes() == line(1)
    with pytest.raises(ValueError):
        RotatingLog(path, max_bytes=0, keep=1)


@pytest.mark.integration
def test_the_launcher_pumps_a_childs_output_through_the_rotating_log(tmp_path):
    script = "import json, sys\nfor n in range(50):\n    print(json.dumps({'event': 'tick', 'n': f'{n:03d}'}))\n"
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    child = Child("reward-0", "reward", process, tmp_path / "reward-0.log", log_max_bytes=10 * LINE, log_keep=3)
    child.pump(process.stdout)
    process.wait(timeout=30)
    files = [tmp_path / "reward-0.log.3", tmp_path / "reward-0.log.2", tmp_path / "reward-0.log.1"]
    kept = b"".join(path.read_bytes() for path in [*files, tmp_path / "reward-0.log"])
    assert kept == b"".join(line(n) for n in range(10, 50))  # 10 lines a file, 4 files: the last 40 lines
    assert child.dropped_lines == 0


# ------------------------------------------------------------------ metrics.jsonl rolling into parts


def test_a_record_rolls_into_numbered_parts_that_every_reader_reads_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsLog(path, max_bytes=300)
    follower = JsonlFollower(path)
    followed = []
    for step in range(1, 21):
        metrics.write({"step": step, "loss": 0.5})
        if step % 12 == 0:  # several rolls between two polls: the follower reads every part once
            metrics.flush()  # rows are written on the writer's thread
            followed += [row["step"] for row in follower.new_rows()]
    metrics.close()
    followed += [row["step"] for row in follower.new_rows()]
    parts = jsonl_parts(path)
    assert len(parts) > 3 and parts[0] == rolled_part(path, 1) and parts[-1] == path
    assert all(part.stat().st_size <= 300 for part in parts)
    assert [row["step"] for row in read_jsonl(path)] == list(range(1, 21))
    assert followed == list(range(1, 21))
    # A follower started late reads the parts already rolled, then the current file.
    assert [row["step"] for row in JsonlFollower(path).new_rows()] == list(range(1, 21))


def test_a_follower_of_a_rotating_log_reads_each_line_once_across_rotations(tmp_path):
    path = tmp_path / "trainer.log"
    log = RotatingLog(path, max_bytes=3 * LINE, keep=5)
    follower = JsonlFollower(path)
    seen = []
    for n in range(20):
        log.write(line(n))
        if n % 2 == 0:  # more often than it rotates (every third line), as a 0.5 s poll of 100 MiB files is
            seen += follower.new_lines()
    seen += follower.new_lines()
    log.close()
    assert seen == [line(n).rstrip(b"\n") for n in range(20)]


def test_a_service_with_a_log_dir_also_writes_its_lines_to_a_rotating_file(tmp_path):
    path = tmp_path / "logs" / "reward-host.log"  # the folder is made
    root = logging.getLogger()
    kept = root.handlers[:], root.level
    try:
        setup_logging("reward", "run-a", "INFO", path, max_bytes=400, keep=1)
        for n in range(12):
            log_event(logging.getLogger("test"), Event.READY, n=n)
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:], root.level = kept
    files = (path.with_name("reward-host.log.1"), path)
    lines = [json.loads(line) for part in files for line in part.read_text().splitlines()]
    assert sorted(p.name for p in path.parent.iterdir()) == ["reward-host.log", "reward-host.log.1"]
    # Only the newest lines survive the rotation, each whole, with the service's and the run's names.
    assert [row["n"] for row in lines] == list(range(12 - len(lines), 12)) and len(lines) < 12
    assert {(row["service"], row["run_id"], row["event"]) for row in lines} == {("reward", "run-a", "ready")}
