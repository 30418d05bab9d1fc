"""`rlpipe runs`: each local run's state, step and resources, read from the files the run left."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli.app import app
from services.cli.runs import list_runs, record_exit
from services.common.observe.usage import USAGE_FILE

pytestmark = pytest.mark.unit


def make_run(root: Path, name: str, steps: int, code: int | None = None, usage: dict | None = None) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": name}))
    rows = [{"step": step, "reward_mean": 0.5} for step in range(1, steps + 1)]
    rows.append({"event": "eval", "accuracy": 0.4})  # a row without a step after the last step's
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if code is not None:
        record_exit(run_dir, code)
    if usage is not None:
        (run_dir / USAGE_FILE).write_text(json.dumps(usage))
    return run_dir


def test_each_run_gets_its_state_from_its_launcher_lock_and_exit_record(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "done", steps=4, code=0)
    make_run(root, "refused", steps=0, code=2)
    make_run(root, "crashed", steps=2, code=1)
    make_run(root, "interrupted", steps=3, code=130)
    make_run(root, "killed", steps=5)  # a SIGKILLed launcher leaves no exit record and holds nothing
    live = make_run(root, "live", steps=7, code=0)  # exit.json of an earlier start; the launcher holds it now
    (root / "not-a-run").mkdir()
    with (root / "live.launcher.lock").open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as hold_run does for a live launcher
        rows = {row.run_id: (row.state, row.exit_code, row.step) for row in list_runs(root)}
    assert rows == {
        "done": ("finished", 0, 4),
        "refused": ("refused", 2, None),
        "crashed": ("failed", 1, 2),
        "interrupted": ("stopped", 130, 3),
        "killed": ("failed", None, 5),
        "live": ("running", None, 7),
    }
    assert live.is_dir()
    (killed,) = [row for row in list_runs(root) if row.run_id == "killed"]
    assert killed.note == "no exit record and no live launcher: it was killed"
    # Released: the live one's own exit record speaks again.
    assert [row.state for row in list_runs(root) if row.run_id == "live"] == ["finished"]


def test_the_runs_command_prints_each_run_with_its_resources(tmp_path):
    root = tmp_path / "runs"
    usage = {"device_hours": {"trainer": {"cpu-core": 0.25}, "rollout-0": {"cpu-core": 0.5, "gpu": 1.5}}, "cost": 3.5}
    make_run(root, "priced", steps=12, code=0, usage=usage)
    make_run(root, "unpriced", steps=1, code=1, usage={"device_hours": {"trainer": {"cpu-core": 0.125}}, "cost": None})
    result = CliRunner().invoke(app, ["runs", str(root)], terminal_width=200)
    assert result.exit_code == 0, result.output
    lines = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") == 5}
    assert set(lines) == {"priced", "unpriced"}
    assert [cell.strip() for cell in lines["priced"].split("│")[2:5]] == [
        "finished (0)",
        "12",
        "0.750 cpu-core-h, 1.500 gpu-h; cost 3.5000",
    ]
    assert [cell.strip() for cell in lines["unpriced"].split("│")[2:5]] == ["failed (1)", "1", "0.125 cpu-core-h"]


def test_the_runs_command_lists_each_run_as_json(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "priced", steps=12, code=0, usage={"device_hours": {"trainer": {"cpu-core": 0.25}}, "cost": 3.5})
    result = CliRunner().invoke(app, ["runs", str(root), "--json"])
    assert result.exit_code == 0, result.output
    [run] = json.loads(result.output)
    assert (run["run_id"], run["state"], run["exit_code"], run["step"]) == ("priced", "finished", 0, 12)
    assert run["resources"] == {"device_hours": {"trainer": {"cpu-core": 0.25}}, "cost": 3.5}


def test_the_runs_command_says_when_there_are_none(tmp_path):
    result = CliRunner().invoke(app, ["runs", str(tmp_path / "nowhere")])
    assert result.exit_code == 0 and result.output == f"no runs in {tmp_path / 'nowhere'}\n"
