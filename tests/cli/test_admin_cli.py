"""`rlpipe metrics` and `rlpipe logs` read a live run's files, which the trainer may be halfway through writing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def cli_process(run_dir: Path, *args: str, **options) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "--run-dir", str(run_dir), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **options,
    )


def row(step: int) -> str:
    return json.dumps({"time": 1.0, "step": step, "reward_mean": step / 10, "entropy": 1.5, "config_version": 0}) + "\n"


def test_metrics_follow_waits_for_a_half_written_row(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    second = row(2)
    metrics.write_text(row(1) + json.dumps({"step": 1, "checkpoint_saved": True}) + "\n" + second[:25])
    follower = cli_process(tmp_path, "metrics", "--follow")
    try:
        assert follower.stdout.readline().startswith("step=1  config_version=0  reward_mean=0.1  entropy=1.5")
        time.sleep(1.5)  # the follower has read the half row by now and must keep it
        with metrics.open("a") as out:
            out.write(second[25:] + row(3))
        assert follower.stdout.readline().startswith("step=2  config_version=0  reward_mean=0.2")
        assert follower.stdout.readline().startswith("step=3")
    finally:
        follower.kill()
        follower.communicate()


def test_metrics_and_logs_print_what_is_there(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(row(1) + row(2))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "reward-0.log").write_text('{"event": "ready"}\nplain line\n')
    out, _ = cli_process(tmp_path, "metrics", "--keys", "step,reward_mean").communicate(timeout=60)
    assert out.splitlines() == ["step=1  reward_mean=0.1", "step=2  reward_mean=0.2"]
    unknown = cli_process(tmp_path, "metrics", "--keys", "step,reward_men")
    _, err = unknown.communicate(timeout=60)
    assert unknown.returncode == 2 and "'reward_men' is not a metric the trainer writes" in err
    out, _ = cli_process(tmp_path, "logs", "reward-0").communicate(timeout=60)
    assert out.splitlines() == ['{"event": "ready"}', "plain line"]
    missing = cli_process(tmp_path, "logs", "rollout-7")
    _, err = missing.communicate(timeout=60)
    assert missing.returncode == 2 and err == f"rlpipe: {tmp_path / 'logs' / 'rollout-7.log'} does not exist\n"
