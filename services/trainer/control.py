"""Operator control: the command queue and the run state it moves (running, paused, stopping, done).

Commands that change training (pause, rollback, checkpoint, stop) are not run by whoever
asks (the Admin service, an alert): they are queued, and the training loop runs them
between steps in its own task, so no command ever lands in the middle of a step's
bookkeeping. A pause or stop is also stored in the run's config bucket, so a trainer that
restarts (or that Kubernetes restarts after a stop) comes back held. The stored hold names who
set it (``HoldSource``): one an alert set outlives ``rlpipe run --resume``, so a stop while an
alert holds the run keeps the alert as the hold's source.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any, Protocol

from services.common.observe.events import Event, Journal
from services.common.observe.logs import log_event
from services.common.transport.live_config import Hold, HoldSource
from services.trainer.progress import Progress

log = logging.getLogger(__name__)

Command = Callable[[], Any]


class RunState(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    DONE = "done"


class HoldStore(Protocol):
    """Where a pause or stop is kept across restarts (the run's config bucket: ``LiveConfig``)."""

    async def put_control(self, control: dict[str, Any]) -> None: ...

    async def get_control(self) -> dict[str, Any]: ...


class Control:
    def __init__(self, holds: HoldStore, journal: Journal, progress: Progress):
        self.holds = holds
        self.journal = journal
        self.progress = progress
        self.state = RunState.RUNNING
        self.paused_reason = ""
        self.held_by: HoldSource | None = None  # who paused the run, while it is paused
        self.stop_reason = ""
        self.commands: asyncio.Queue[tuple[Command, asyncio.Future]] = asyncio.Queue()
        self.wakeup = asyncio.Event()
        self.on_unpause: list[Callable[[], None]] = []  # alert clocks and rollback memory restart on a resume

    # -- the queue ------------------------------------------------------------------

    async def call(self, command: Command) -> Any:
        """Run ``command`` in the training loop between steps and return its result (or raise its error)."""
        done = asyncio.get_running_loop().create_future()
        await self.commands.put((command, done))
        self.wake()
        return await done

    def submit(self, command: Command) -> None:
        """Queue ``command`` with nobody waiting for it (an alert's action); it must handle its own errors."""
        self.commands.put_nowait((command, asyncio.get_running_loop().create_future()))
        self.wake()

    def wake(self) -> None:
        """Make the loop look at commands and config now instead of finishing the batch it is collecting."""
        self.wakeup.set()

    async def run_commands(self) -> None:
        self.wakeup.clear()
        while not self.commands.empty():
            command, done = self.commands.get_nowait()
            if done.cancelled():  # the caller's deadline passed or it hung up: a retry must not find it done twice
                log_event(log, Event.COMMAND_SKIPPED, level=logging.WARNING, reason="caller gone")
                continue
            try:
                result = command()
                if asyncio.iscoroutine(result):
                    result = await result
            except Exception as error:  # the caller gets it; training goes on
                if not done.done():
                    done.set_exception(error)
            else:
                if not done.done():
                    done.set_result(result)

    # -- the state --------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.state == RunState.RUNNING

    async def pause(self, reason: str, by: HoldSource = HoldSource.OPERATOR) -> None:
        """Hold training; kept in the run's config bucket so a restarted trainer stays paused."""
        if self.state == RunState.RUNNING:
            self.state, self.paused_reason, self.held_by = RunState.PAUSED, reason, by
            self.journal.emit(Event.PAUSED, reason, step=self.progress.step, reason=reason, by=str(by))
            await self._store_hold(Hold(True, reason, by))

    async def unpause(self) -> None:
        for hook in self.on_unpause:
            hook()
        if self.state == RunState.PAUSED:
            self.state, self.paused_reason, self.held_by = RunState.RUNNING, "", None
            self.journal.emit(Event.UNPAUSED, "resumed by operator", step=self.progress.step)
            await self._store_hold(Hold())

    async def request_stop(self, reason: str, by: HoldSource = HoldSource.OPERATOR) -> None:
        """Drain and end the run. An orchestrator that restarts the trainer anyway (Kubernetes) gets it back paused.

        Stopped while an alert held it, the stored hold stays the alert's: nobody has lifted it."""
        held = f"stopped: {reason}"
        if self.state == RunState.PAUSED and self.held_by == HoldSource.ALERT:
            held, by = f"{held}, while held: {self.paused_reason}", HoldSource.ALERT
        self.state, self.stop_reason = RunState.STOPPING, reason
        self.journal.emit(Event.STOP_REQUESTED, reason, step=self.progress.step, reason=reason)
        await self._store_hold(Hold(True, held, by))

    async def restore_hold(self) -> None:
        """A pause or stop stored before this process started holds it too."""
        hold = Hold.of_record(await self.holds.get_control())
        if hold.paused:
            self.state, self.held_by = RunState.PAUSED, hold.by
            self.paused_reason = f"{hold.reason} (still paused after a restart)"
            # The pause recorded when it began holds on: logged, not recorded again.
            log_event(log, Event.PAUSED, step=self.progress.step, reason=self.paused_reason)

    async def wait_while_held(self, timeout_s: float, on_idle: Callable[[], Awaitable[None]]) -> None:
        """Wait for a command or config change; ``on_idle`` runs when none came within ``timeout_s``."""
        try:
            await asyncio.wait_for(self.wakeup.wait(), timeout=timeout_s)
        except TimeoutError:
            await on_idle()

    async def _store_hold(self, hold: Hold) -> None:
        try:
            await self.holds.put_control(hold.record())
        except Exception as error:  # the broker's failures: the pause holds in this process regardless
            log_event(log, Event.CONTROL_NOT_STORED, level=logging.WARNING, error=repr(error)[:200])
