"""``rlpipe runs``: the local runs under a runs root, each with its state, last step and resources.

Read from the files a run leaves, never from its services (a finished run has none):

- ``<run>.launcher.lock`` beside the run directory, which ``rlpipe run`` holds with ``flock`` while it lives (the
  kernel drops the hold when the launcher ends, SIGKILL included): held = running;
- ``<run>/exit.json``, which the launcher writes as it ends (:func:`record_exit`): finished, failed, refused or
  stopped, and the exit code;
- ``<run>/metrics.jsonl`` (and its rolled parts): the last step trained;
- ``<run>/usage.json``: device-hours per role and the cost, written when the run ends.

A directory with a run's files but no exit record and no live launcher ended without recording one (its launcher
was killed): it is listed as failed, saying so.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from services.common.files import write_atomically
from services.common.observe.logs import jsonl_parts
from services.common.observe.records import MetricsRow
from services.common.observe.usage import USAGE_FILE
from services.common.service import EXIT_REFUSED

EXIT_FILE = "exit.json"
RUN_FILES = ("run.json", "metrics.jsonl", EXIT_FILE, USAGE_FILE)  # any of them makes a folder a run's
TAIL_BYTES = 64 << 10  # enough of metrics.jsonl's end to hold its last rows


def exit_state(code: int) -> str:
    """What ``rlpipe run``'s exit code says about the run."""
    if code == 0:
        return "finished"
    if code == EXIT_REFUSED:
        return "refused"
    if code > 128:  # 128 + the signal: Ctrl-C or a supervisor's SIGTERM ended it in order
        return "stopped"
    return "failed"


def record_exit(run_dir: Path, code: int) -> None:
    """``<run>/exit.json`` as the launcher ends: how the run ended, for ``rlpipe runs``."""
    record = {"state": exit_state(code), "code": code}
    write_atomically(run_dir / EXIT_FILE, json.dumps(record).encode())


def launcher_holds(run_dir: Path) -> bool:
    """Whether a live ``rlpipe run`` holds ``run_dir`` (its lock file, beside the directory, is flocked)."""
    lock = run_dir.with_name(f"{run_dir.name}.launcher.lock")
    if not lock.is_file():
        return False
    with lock.open() as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def last_step(metrics: Path) -> int | None:
    """The step of the newest metrics row that has one, reading only the end of the newest part that has rows."""
    for part in reversed(jsonl_parts(metrics)):
        with part.open("rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(size - TAIL_BYTES, 0))
            lines = handle.read().splitlines()
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                values = json.loads(line)
                if isinstance(values, dict) and (step := MetricsRow(values).step) is not None:
                    return step
    return None


@dataclass(frozen=True)
class Resources:
    """What usage.json says the run used: device-hours by role and kind, and the cost when it was priced."""

    device_hours: dict[str, dict[str, float]]
    cost: float | None

    def text(self) -> str:
        totals: dict[str, float] = {}
        for kinds in self.device_hours.values():
            for kind, hours in kinds.items():
                totals[kind] = totals.get(kind, 0.0) + hours
        used = ", ".join(f"{hours:.3f} {kind}-h" for kind, hours in sorted(totals.items()) if hours > 0) or "none"
        return used if self.cost is None else f"{used}; cost {self.cost:.4f}"


@dataclass(frozen=True)
class RunRow:
    run_id: str
    path: Path
    state: str  # running, finished, failed, refused or stopped
    exit_code: int | None
    step: int | None
    resources: Resources | None
    note: str = ""


def read_resources(run_dir: Path) -> Resources | None:
    try:
        record = json.loads((run_dir / USAGE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return Resources(device_hours=record.get("device_hours") or {}, cost=record.get("cost"))


def read_run(run_dir: Path) -> RunRow:
    step, resources = last_step(run_dir / "metrics.jsonl"), read_resources(run_dir)
    if launcher_holds(run_dir):
        return RunRow(run_dir.name, run_dir, "running", None, step, resources)
    try:
        record = json.loads((run_dir / EXIT_FILE).read_text())
        code = int(record["code"])
    except (OSError, ValueError, KeyError, TypeError):
        note = "no exit record and no live launcher: it was killed"
        return RunRow(run_dir.name, run_dir, "failed", None, step, resources, note)
    return RunRow(run_dir.name, run_dir, exit_state(code), code, step, resources)


def list_runs(root: Path) -> list[RunRow]:
    """Every run directory under ``root``, newest first (by the last change to any of its files)."""
    if not root.is_dir():
        return []
    folders = [path for path in root.iterdir() if path.is_dir() and any((path / f).exists() for f in RUN_FILES)]

    def changed(folder: Path) -> float:
        return max((folder / f).stat().st_mtime for f in RUN_FILES if (folder / f).exists())

    return [read_run(folder) for folder in sorted(folders, key=changed, reverse=True)]


def runs_table(root: Path, rows: list[RunRow]) -> Table:
    table = Table(title=f"runs in {root}")
    for column in ("run", "state", "step", "resources"):
        table.add_column(column, justify="right" if column == "step" else "left")
    for row in rows:
        state = row.state if row.exit_code is None else f"{row.state} ({row.exit_code})"
        if row.note:
            state = f"{state}: {row.note}"
        resources = row.resources.text() if row.resources else "-"
        table.add_row(row.run_id, state, "-" if row.step is None else str(row.step), resources)
    return table
