"""``runs/<run>/events.jsonl``: what happened to a run besides its steps.

One JSON line per event: ``{"time", "step", "kind", "message", ...}`` with kind one of
config_change, alert, rollback, resume, restart, pause, unpause, stop. The report marks
them on its curves; operators read them to line up a metric swing with its cause.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class EventLog:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, message: str, step: int | None = None, **extra: Any) -> None:
        row = {"time": round(time.time(), 3), "step": step, "kind": kind, "message": message, **extra}
        with self.path.open("a") as out:
            out.write(json.dumps(row, default=str) + "\n")
