"""Tune files for the tuner's tests, the `rlpipe tune` command line, and the processes a trial left behind."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from services.tuner.procs import group_members


def tune_file(tmp_path: Path, base: Path, **fields) -> Path:
    """A tune file over the run config ``base``: one learning rate to search, its workdir under ``tmp_path``;
    ``fields`` add or replace its top-level fields."""
    data = {
        "study": "s",
        "base_config": str(base),
        "workdir": str(tmp_path / "tune"),
        "space": {"train.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        **fields,
    }
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


TUNE = [sys.executable, "-m", "services.cli", "tune"]


def runnable_tune_file(tmp_path: Path, base: Path, **fields) -> Path:
    """A tune file whose trials run: two steps each, scored on the final evaluation, none pruned."""
    runnable = {
        "objective": {"metric": "eval_accuracy", "reduce": "final", "direction": "maximize"},
        "pruner": {"kind": "none"},
        "trial": {"max_steps": 2, "max_wall_s": 300, "stop_grace_s": 10, "poll_s": 0.2},
    }
    return tune_file(tmp_path, base, **{**runnable, **fields})


def alive(pgid: int | None) -> list[int]:
    """The pids still alive in the process group ``pgid`` (a trial's), none for no group."""
    return [m.pid for m in group_members(pgid)] if pgid else []
