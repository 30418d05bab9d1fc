"""A deterministic crash is not restarted ten times.

A role that dies of the same Python exception at the same line twice in a row, with no step of the run applied in
between, will die the same way on every restart: a bad tokenizer, a missing file, a bug on the path every start
takes. Restarting it until ``supervision.max_restarts`` runs out only hides the cause under minutes of backoff. So
the launcher stops after the second such crash and ends the run naming the role, the exception's last line and the
log. A crash that moves (another line, another message), one without a Python traceback (a native crash, a kill),
and one after the run made progress (a step applied since the role started) is left to the restart policy, since a
restart may well get past it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# The innermost frame of a Python traceback: the line the exception was raised at.
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')


@dataclass(frozen=True)
class Crash:
    """One crash of a role, as its ``crashed`` log event's traceback tells it."""

    error: str  # the traceback's last line: "RuntimeError: Could not infer dtype of NoneType"
    where: str  # the innermost frame: "services/common/model/evaluation.py:61 in greedy_generate"

    @classmethod
    def of_traceback(cls, text: str) -> Crash | None:
        """The crash a formatted traceback describes; None for text that is not one."""
        lines = [line for line in text.splitlines() if line.strip()]
        frames = [match for line in lines if (match := _FRAME.match(line))]
        if not lines or not frames:
            return None
        innermost = frames[-1]
        return cls(
            error=lines[-1].strip(),
            where=f"{innermost['file']}:{innermost['line']} in {innermost['function']}",
        )


@dataclass
class CrashLoopGuard:
    """Remembers each service's last crash, and whether the run moved since, to tell a deterministic crash."""

    last: dict[str, Crash] = field(default_factory=dict)

    def repeated(self, name: str, crash: Crash | None, progressed: bool) -> Crash | None:
        """The crash ``name``'s exit repeats, if it died of ``crash`` (None: no traceback) exactly as last time with
        no progress between the two: restarting it again is pointless. None otherwise."""
        previous = self.last.pop(name, None)
        if crash is None:
            return None
        self.last[name] = crash
        return crash if not progressed and previous == crash else None
