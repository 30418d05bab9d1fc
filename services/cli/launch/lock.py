"""One launcher per run on a machine, and no fresh start over an earlier run's checkpoints by accident."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import IO

from services.common.config import RunConfig


def previous_run(cfg: RunConfig) -> list[str]:
    """What of an earlier run under this run id a fresh start would destroy: local checkpoints, metrics."""
    found = []
    steps = sorted(path.name for path in cfg.run_dir.glob("step-*") if path.is_dir())
    if steps:
        found.append(f"{len(steps)} checkpoint{'s' if len(steps) > 1 else ''} ({steps[0]} to {steps[-1]})")
    if cfg.metrics_file.is_file() and cfg.metrics_file.stat().st_size > 0:
        found.append(f"metrics in {cfg.metrics_file}")
    return found


class RunIsLive(RuntimeError):
    """Another ``rlpipe run`` of this run id is running on this machine."""


def launcher_lock(cfg: RunConfig) -> Path:
    """``runs/<run>.launcher.lock``, beside the run directory: ``--overwrite`` deletes the directory, not the lock."""
    return cfg.run_dir.with_name(f"{cfg.run_dir.name}.launcher.lock")


def hold_run(cfg: RunConfig) -> IO[str]:
    """Hold this run for this launcher's life (an exclusive ``flock``, which the kernel drops when the process ends,
    SIGKILL included), or raise RunIsLive naming the launcher that holds it and where its run is served.

    The open file is the hold: closing it lets another launcher in. On one machine only; a trainer on another
    machine is kept out by the trainer's lease (services/trainer/lease.py)."""
    path = launcher_lock(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        served = ""
        with contextlib.suppress(OSError, ValueError):
            info = json.loads((cfg.run_dir / "run.json").read_text())
            served = f", its broker at {info['nats_url']}"
        raise RunIsLive(f"run {cfg.run_id} in {cfg.run_dir} is live: launcher pid {holder} runs it{served}") from None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
