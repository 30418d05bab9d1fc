"""``runs/<run>/events.jsonl``: what happened to a run besides its steps.

One JSON line per event: ``{"time", "step", "kind", "message", ...}`` with kind one of
config_change, alert, rollback, resume, restart, checkpoint_fallback, pause, unpause, stop. The report marks
them on its curves; operators read them to line up a metric swing with its cause.

Two processes write it, the launcher (restarts) and the trainer (everything else), each line
whole: past ``telemetry.jsonl_max_mib`` it rolls to ``events.00001.jsonl`` and so on like
``metrics.jsonl`` (``RollingJsonl``, whose lock lets either writer roll it). Readers go through
``jsonl_parts``: ``services.cli.report.read_jsonl`` for the whole record, ``JsonlFollower`` to follow it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from services.common.config import RunConfig
from services.common.observe.logs import RollingJsonl


class EventLog:
    def __init__(self, path: Path, max_bytes: int | None = None):
        self.path = path
        # Without max_bytes one file grows for ever (a drill's or a test's short record).
        self.file = RollingJsonl(path, max_bytes or sys.maxsize)

    @classmethod
    def of_run(cls, cfg: RunConfig) -> EventLog:
        """The run's ``events.jsonl``, rolled at ``telemetry.jsonl_max_mib`` like its metrics."""
        return cls(cfg.run_dir / "events.jsonl", cfg.telemetry.jsonl_max_mib * 2**20)

    def write(self, kind: str, message: str, step: int | None = None, **extra: Any) -> None:
        row = {"time": round(time.time(), 3), "step": step, "kind": kind, "message": message, **extra}
        self.file.write(json.dumps(row, default=str) + "\n")
