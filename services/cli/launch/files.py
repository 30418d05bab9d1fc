"""What ``rlpipe run`` writes about its own start for tools and tests: ``startup.jsonl`` (when each component was ready,
in seconds after the launch) and ``run.json`` (where every process and endpoint is)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from services.cli.launch.children import Child
from services.common.files import write_atomically

# The endpoints a ready service reports that tools look up in run.json.
ENDPOINTS = ("grpc", "admin", "metrics_url")


class StartupRecord:
    """``runs/<run>/startup.jsonl``, one JSON line per component (nats, each service, "first step"): what it loaded
    and when it was ready, counted on the wall clock from the launch, so that a replica's own ``ready_at`` and the
    moment the launcher learned something compare alike."""

    def __init__(self, run_dir: Path, launched_at: float):
        self.path = run_dir / "startup.jsonl"
        self.launched_at = launched_at
        self.ready_after_s: dict[str, float] = {}  # component -> seconds after the launch; the run summary shows it

    def __contains__(self, component: str) -> bool:
        return component in self.ready_after_s

    def __getitem__(self, component: str) -> float:
        return self.ready_after_s[component]

    def record(self, component: str, facts: dict[str, Any]) -> None:
        """The component's facts, ready at their ``ready_at`` (the replica's own clock) where they say so, else now."""
        ready_at = facts.get("ready_at")
        ready_at = ready_at if isinstance(ready_at, (int, float)) else time.time()
        self.ready_after_s[component] = round(ready_at - self.launched_at, 3)
        row = {"component": component, "ready_after_s": self.ready_after_s[component]}
        row |= {k: v for k, v in facts.items() if k not in ("level", "event")}
        with self.path.open("a") as out:
            out.write(json.dumps(row) + "\n")


def write_run_file(
    run_dir: Path, run_id: str, nats_url: str, nats_pid: int, children: list[Child], restarts: dict[str, int]
) -> None:
    """``runs/<run>/run.json``: the broker, every service's pid and endpoints, and the restarts so far. Written
    atomically: the CLI and tests read it while the run goes on."""
    trainer = next((c.ready for c in children if c.role == "trainer" and c.ready), None)
    info = {
        "run_id": run_id,
        "nats_url": nats_url,
        "trainer": trainer["grpc"] if trainer else None,
        "admin": trainer["admin"] if trainer else None,
        "pids": {"nats": nats_pid, **{c.name: c.process.pid for c in children}},
        "restarts": restarts,
        "services": {
            c.name: {
                "role": c.role,
                "pid": c.process.pid,
                **{k: c.ready[k] for k in ENDPOINTS if c.ready and k in c.ready},
            }
            for c in children
        },
    }
    write_atomically(run_dir / "run.json", json.dumps(info, indent=2).encode())
