"""`rlpipe metrics` and `rlpipe logs` read a live run's files, which the trainer may be halfway through writing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli.app import app
from tests.support.paths import ROOT
from tests.support.runs import wait_for

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


def read_position(pid: int, path: Path) -> int | None:
    """Where process ``pid`` has read ``path`` up to (Linux's /proc fdinfo); None while it has not opened it."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if Path(os.readlink(fd)) == path.resolve():
                return int((Path(f"/proc/{pid}/fdinfo") / fd.name).read_text().split()[1])  # "pos:\t<offset>"
        except FileNotFoundError:  # closed since the listing
            continue
    return None


def row(step: int) -> str:
    return json.dumps({"time": 1.0, "step": step, "reward_mean": step / 10, "entropy": 1.5, "config_version": 0}) + "\n"


def test_metrics_follow_waits_for_a_half_written_row(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    second = row(2)
    metrics.write_text(row(1) + json.dumps({"step": 1, "checkpoint_saved": True}) + "\n" + second[:25])
    follower = cli_process(tmp_path, "metrics", "--follow")
    try:
        assert follower.stdout.readline().startswith("step=1  config_version=0  reward_mean=0.1  entropy=1.5")
        # Only once the follower has read the half row does the rest of the row test that it kept it.
        half_read = lambda: read_position(follower.pid, metrics) == metrics.stat().st_size  # noqa: E731
        wait_for(half_read, "the follower's read of the half row", follower, timeout=30)
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


@pytest.mark.unit
def test_the_newest_run_is_found_under_rlpipe_runs_dir_or_runs_dir_not_only_under_runs(tmp_path, monkeypatch):
    from services.cli.admin.client import Target

    elsewhere = tmp_path / "elsewhere"
    for name in ("older", "newer"):
        (elsewhere / name).mkdir(parents=True)
        (elsewhere / name / "run.json").write_text('{"admin": "127.0.0.1:1"}')
    os.utime(elsewhere / "older" / "run.json", (1, 1))
    monkeypatch.chdir(tmp_path)  # no runs/ here
    monkeypatch.setenv("RLPIPE_RUNS_DIR", str(elsewhere))
    assert Target("", "", 0.0, None, None).run_dir == elsewhere / "newer"
    monkeypatch.delenv("RLPIPE_RUNS_DIR")
    assert Target("", "", 0.0, None, None, runs_dir=elsewhere).run_dir == elsewhere / "newer"
    assert Target("", "", 0.0, None, None).run_dir is None


@pytest.mark.unit
def test_a_run_command_that_finds_no_run_names_the_folder_it_looked_in_and_how_to_point_elsewhere(tmp_path):
    result = CliRunner().invoke(app, ["--runs-dir", str(tmp_path), "status"])
    assert result.exit_code == 2
    said = " ".join(result.output.split())
    assert f"no {tmp_path}/*/run.json found" in said and "--runs-dir or RLPIPE_RUNS_DIR" in said


@pytest.mark.unit
def test_the_cli_uses_the_admin_token_by_default_and_the_read_token_with_read_only(tmp_path, monkeypatch):
    from services.cli.admin.client import Target

    for name in ("RLPIPE_ADMIN_TOKEN", "RLPIPE_ADMIN_READ_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "admin.token").write_text("admin-file\n")
    (tmp_path / "admin-read.token").write_text("read-file\n")

    def token(given: str = "", read_only: bool = False) -> str:
        return Target("127.0.0.1:1", given, 0.0, tmp_path, None, read_only=read_only).token()

    assert (token(), token(read_only=True)) == ("admin-file", "read-file")
    monkeypatch.setenv("RLPIPE_ADMIN_TOKEN", "admin-env")
    monkeypatch.setenv("RLPIPE_ADMIN_READ_TOKEN", "read-env")
    assert (token(), token(read_only=True)) == ("admin-env", "read-env")
    assert (token("given"), token("given", read_only=True)) == ("given", "given")  # --token wins either way
