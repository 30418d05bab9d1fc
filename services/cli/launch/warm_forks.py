"""How ``rlpipe run`` starts its roles warm (``service.warm_start``): forked from a process that already imported
torch and the roles' modules (services/cli/launch/warm_start.py), a warm starter of the run's own or a session of the
machine's pool (``service.warm_start_pool``).

``WarmForks`` holds that policy for the Launcher (services/cli/launch/launcher.py): one that died is started again when
the next role needs it; one that cannot be started or fails to fork is said once (``warm_start_failed`` in
events.jsonl and on the console) and every role starts cold from then on (``spawn`` returns None, the Launcher
starts the process itself).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from rich.console import Console

from services.cli.launch.warm_start import WarmProcess, WarmStarter, WarmStartError, preload_modules
from services.common.config import RunConfig
from services.common.observe.events import Event, EventLog
from services.common.parent_death import dies_with_this_process


class WarmForks:
    """The warm starter of one run, started, restarted after it died, or given up for cold starts."""

    def __init__(self, cfg: RunConfig, events: EventLog, console: Console, environment: Callable[[], dict[str, str]]):
        self.cfg = cfg
        self.events = events
        self.console = console
        self.environment = environment  # what the warm starter's own process inherits
        self.starter: WarmStarter | None = None

    @property
    def pid(self) -> int | None:
        """The running warm starter's process (its imports are spent for every role); None without one."""
        return self.starter.process.pid if self.starter is not None and self.starter.alive else None

    def start(self) -> None:
        """Start (or join) the warm starter, importing while the broker starts; nothing with warm starts off."""
        if not self.cfg.service.warm_start:
            return
        pool = self.cfg.service.warm_start_pool
        try:
            if pool is not None:
                self.starter = WarmStarter.join(pool)
                return
            modules = preload_modules(vllm_rollout=self.cfg.rollout.backend == "vllm")
            log = self.cfg.run_dir / "logs" / "warm-start.log"
            self.starter = WarmStarter.start(modules, self.environment(), log, dies_with_this_process())
        except WarmStartError as error:
            self.failed(error)

    def spawn(self, command: list[str], env: dict[str, str]) -> WarmProcess | None:
        """``command`` forked from the warm starter (a new one if it died); None where it cannot be: torchrun,
        warm starts off, or a warm starter that fails, which is said once, and every role then starts cold."""
        if self.starter is None or command[:2] != [sys.executable, "-m"]:
            return None
        try:
            if not self.starter.alive:
                self.close()
                self.start()
                if self.starter is None:
                    return None
            return self.starter.spawn(command, env)
        except WarmStartError as error:
            self.failed(error)
            return None

    def failed(self, error: WarmStartError) -> None:
        self.console.log(f"[yellow]warm start failed, starting every role cold from now on:[/] {error}")
        self.events.write(Event.WARM_START_FAILED, str(error), service="warm-start")
        self.close()  # none from now on: spawn finds no warm starter

    def close(self) -> None:
        if self.starter is not None:
            self.starter.close()
            self.starter = None

    def kill(self) -> None:
        if self.starter is not None:
            self.starter.process.kill()
            self.close()
