"""How a run's processes end: each service gets its own grace after SIGTERM before SIGKILL (``stop_children``), or
all are killed at once when a stop is cut short (``kill_children``); the broker and the warm-start parent go last."""

from __future__ import annotations

import signal
import subprocess
import time
from typing import TYPE_CHECKING

from services.cli.launch.children import Child
from services.cli.launch.narration import console
from services.common.config import SupervisionConfig

if TYPE_CHECKING:
    from services.cli.launch.launcher import Launcher


def stop_grace_s(supervision: SupervisionConfig, child: Child) -> float:
    """How long ``child`` may take to exit after SIGTERM: the trainer saves a final checkpoint first. A stage
    not ready yet gets none: it holds no work, and while it waits for the trainer's streams it does not heed
    SIGTERM (docs/architecture.md), so a start cut short (a trainer that refused) would wait out its grace."""
    if child.role != "trainer" and child.ready is None:
        return 0.0
    return supervision.trainer_stop_grace_s if child.role == "trainer" else supervision.stop_grace_s


def stop_children(launcher: Launcher) -> list[str]:
    """Stop every process (SIGTERM, then SIGKILL after its own grace); returns the services that failed."""
    launcher.sample_usage(every_s=0)  # the last reading of each process before it goes
    running = [child for child in launcher.children if child.process.poll() is None]
    # A stage seen not ready would be killed at once. A short run can be done before the launcher has read a
    # stage's ready entry (wait_ready stops waiting once the trainer is done): read the entries first.
    unseen = [child for child in running if child.ready is None and child.role != "trainer"]
    if unseen and launcher.presence is not None and launcher.presence.await_reading(timeout_s=3.0):
        for child in unseen:
            launcher.note_ready(child)
    for child in running:
        child.process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    # Shortest grace first: each wait ends at its own deadline, all counted from the same SIGTERM.
    for child in sorted(running, key=lambda child: stop_grace_s(launcher.cfg.supervision, child)):
        grace = stop_grace_s(launcher.cfg.supervision, child)
        if child.role == "trainer" and child.process.poll() is None:
            console.log(f"waiting up to {grace:g}s for the trainer's final save (Ctrl-C again kills it)")
        try:
            child.process.wait(timeout=max(started + grace - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            console.log(f"[red]{child.name} did not exit within {grace:g}s of SIGTERM[/]; killing it")
            child.process.kill()
            child.process.wait()
    for child in launcher.children:
        if child.pump_thread:
            child.pump_thread.join(timeout=5)  # the last lines a service wrote before exiting reach its log
    launcher.warm.close()  # only now: its children die with it
    launcher.close_presence()
    if launcher.broker is not None:
        launcher.broker.stop()
    # A clean stop is exit 0 (or death by our SIGTERM); a crash or a hang that needed SIGKILL is a failure.
    return [c.name for c in launcher.children if c.process.returncode not in (0, -signal.SIGTERM)]


def kill_children(launcher: Launcher) -> list[str]:
    """SIGKILL every process at once (a stop cut short); returns the services it killed."""
    killed = [child.name for child in launcher.children if child.process.poll() is None]
    for child in launcher.children:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()
    launcher.close_presence()
    if launcher.broker is not None:
        launcher.broker.kill()
    launcher.warm.kill()
    return killed
