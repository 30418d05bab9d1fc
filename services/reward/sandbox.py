"""Rule functions run in a child process, each call under a time limit, so none can hang a reward replica.

A thread cannot be stopped and math-verify's own timeouts use SIGALRM, which only works in a
process's main thread; a child process can be killed. The child evaluates the calls it is sent
one by one and answers each at once. When an answer does not come within ``timeout_s``, the
child is killed, that call scores 0 (a completion so pathological that checking it never ends
earns nothing) and a fresh child takes the calls still to do. A function that raises is the
input's fault (a reference it cannot read), and so is one that kills the child outright (a crash
in native code): ``RewardFunctionError`` goes back to the stage, which retries the group and
dead-letters it when it keeps failing.
"""

from __future__ import annotations

import logging
import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.registry import reward_function

log = logging.getLogger(__name__)

CHILD_STARTUP_S = 300.0  # a fresh child's imports (math-verify pulls in sympy) on a busy machine
READY = "ready"


@dataclass(frozen=True)
class RuleCall:
    """One rule function (a registered name or a ``module:function`` path) on one completion."""

    function: str
    text: str
    answer: str
    finish_reason: str


class RewardFunctionError(RuntimeError):
    """A rule function raised on an input: says which function and why."""


def _serve(conn: Connection) -> None:
    """The child: evaluate each batch of calls, answering ``(True, score)`` or ``(False, error)`` per call."""
    import services.common.model.reward_rules  # noqa: F401  # registers the built-in functions in this fresh process

    conn.send(READY)  # imports done: from here on the parent's clock is the calls' own time
    while True:
        calls: list[RuleCall] = conn.recv()
        for call in calls:
            try:
                value = float(reward_function(call.function)(call.text, call.answer, call.finish_reason))
                conn.send((True, value))
            except Exception as error:  # any function's failure is reported, the child goes on
                conn.send((False, repr(error)[:500]))


class RuleSandbox:
    """Evaluates ``RuleCall``s in a child process with a limit per call; ``close()`` ends the child."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.timeouts = 0  # calls killed so far
        # spawn: a child forked from a replica holding a CUDA context or torch threads could deadlock.
        self._context = multiprocessing.get_context("spawn")
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None

    def start(self) -> Connection:
        """The child's end of the pipe, starting a child first if none runs (at start-up and after a kill)."""
        if self._conn is None:
            parent, child = self._context.Pipe()
            process = self._context.Process(target=_serve, args=(child,), daemon=True, name="reward-rules")
            process.start()
            self._process = process
            child.close()
            self._conn = parent
            if not parent.poll(CHILD_STARTUP_S) or parent.recv() != READY:
                self.close()
                raise RuntimeError(f"the rule sandbox's child process did not start within {CHILD_STARTUP_S:g}s")
        return self._conn

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def score(self, calls: list[RuleCall]) -> list[float]:
        """One score per call, in order; a call past the limit scores 0. Raises ``RewardFunctionError``."""
        scores: list[float] = []
        while len(scores) < len(calls):
            conn = self.start()
            conn.send(calls[len(scores) :])
            while len(scores) < len(calls):
                if not conn.poll(self.timeout_s):
                    self._timed_out(calls[len(scores)])
                    scores.append(0.0)
                    break  # the remaining calls go to a new child
                try:
                    ok, value = conn.recv()
                except EOFError:  # the child died on this call (a crash in native code): like a raise, the input's
                    self.close()
                    raise RewardFunctionError(
                        f"reward function {calls[len(scores)].function!r} crashed its process"
                    ) from None
                if not ok:
                    self._drain(conn, len(calls) - len(scores) - 1)
                    raise RewardFunctionError(f"reward function {calls[len(scores)].function!r} failed: {value}")
                scores.append(value)
        return scores

    def _drain(self, conn: Connection, pending: int) -> None:
        """Read the answers still coming for a batch given up on, so the next batch's answers are its own."""
        for _ in range(pending):
            if not conn.poll(self.timeout_s):
                self.close()
                return
            conn.recv()

    def _timed_out(self, call: RuleCall) -> None:
        self.timeouts += 1
        self.close()
        log_event(
            log,
            Event.REWARD_FUNCTION_TIMEOUT,
            level=logging.WARNING,
            function=call.function,
            timeout_s=self.timeout_s,
            completion_chars=len(call.text),
        )
