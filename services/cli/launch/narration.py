"""What the launcher says on the console that started the run: roles' alerts, run events, a hold --resume found,
each role's start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from services.common.observe.events import Event
from services.common.observe.records import EventRecord
from services.common.transport.live_config import Hold, HoldSource

console = Console(stderr=True)

# events.jsonl rows the launcher does not echo: its own (said when written) and the trainer's done (the summary).
LAUNCHER_SAYS = (Event.RESTART, Event.WARM_START_FAILED, Event.CRASH_LOOP, Event.SCALED, Event.DONE)


def echo_alert(line: str) -> None:
    """A role's alert on the console that started the run: unstyled and unwrapped, so it can be grepped."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def held_on_resume(earlier: Hold, run_dir: Path) -> str:
    """Say on the console (one unwrapped line, for a person or a script to grep) what ``--resume`` did with the hold
    it found (``RunBroker.release_hold``); returns the reason of one it left in place, "" when it cleared it or there
    was none."""
    if not earlier.paused:
        return ""
    if earlier.outlives_resume:
        said = (
            f"still held: {earlier.reason}. An alert set this hold, so --resume keeps it: look at "
            f"`rlpipe --run-dir {run_dir} status` and the alert's cause, then `rlpipe --run-dir {run_dir} resume`"
        )
    else:
        setters: dict[HoldSource | None, str] = {
            HoldSource.OPERATOR: "an operator",
            HoldSource.START: "the run's start",
        }
        by = setters.get(earlier.by, "an earlier run")
        said = f"continuing a run that was held ({earlier.reason}, set by {by}): --resume clears that hold"
    console.print(said, markup=False, highlight=False, soft_wrap=True)
    return earlier.reason if earlier.outlives_resume else ""


def event_summary(event: EventRecord) -> str:
    """An ``events.jsonl`` row in a line: its message, and the step and rule where it names them."""
    said = [f"{key}={value}" for key, value in (("step", event.step), ("rule", event.rule)) if value is not None]
    return " ".join([event.message, *said]).strip()


def startup_fields(ready: dict[str, Any]) -> str:
    keys = ("backend", "engine_load_s", "model_load_s", "grpc", "admin")
    return " ".join(f"{k}={ready[k]}" for k in keys if k in ready)
