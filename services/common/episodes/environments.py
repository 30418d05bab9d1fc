"""The environment protocol of multi-turn episodes, its built-in environments and how one is chosen.

An environment is a class with ``reset(task) -> str`` (the text the model's first turn continues: the prompt,
or the prompt with the environment's instructions) and ``step(turn) -> StepResult``. One instance serves one
episode: the rollout constructs it with no arguments, calls ``reset`` once and ``step`` after every model turn.
``rollout.environment`` names a built-in (``calculator``, ``python``) or a plugin's ``module:Class``;
``rollout.environment_url`` an environment served over HTTP (``services.common.episodes.http_environment``).
docs/agents.md walks through writing one.

An observation is tokenized alone, once, and inserted after the model's turn: verbatim, or wrapped as a chat
message of ``rollout.observation_role`` by the model's own template (``observations.py``).
"""

from __future__ import annotations

import ast
import functools
import logging
import math
import numbers
import operator
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import numpy as np

from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.refusal import StartRefused
from services.common.registry import ENVIRONMENTS, import_function
from services.common.sandbox import Box, BoxLimits, probe

log = logging.getLogger(__name__)

Info = dict[str, str | int | float | bool]


@dataclass(frozen=True)
class Task:
    """What an episode is about: the prompt as the trainer fed it, its reference answer, and the row's ``info``
    (``data.columns.info``: a JSON object, empty when the row has none)."""

    prompt_id: str
    prompt: str
    answer: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Turn:
    """One model turn: the text it sampled and the token ids behind it (never re-tokenized)."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to a turn.

    ``observation`` is appended to the episode (loss mask 0) unless ``done``; ``reward_part`` is the environment's
    own score for the turn, summed over the episode: reported, and trained on as the reward part ``environment``
    with ``reward.environment_weight``.
    ``tool_call``/``tool_error`` say whether the turn called a tool and whether the call failed (malformed, or
    the tool raised): they are the episode's tool metrics."""

    observation: str = ""
    reward_part: float = 0.0
    done: bool = False
    tool_call: bool = False
    tool_error: bool = False
    info: Info = field(default_factory=dict)


def off_schema(result: StepResult) -> str | None:
    """Why ``result`` cannot be used (a field of another type, a reward part that is not a finite number), else
    None: a plugin's StepResult is built by code the rollout does not control, an HTTP answer by another service.
    NumPy's numbers and booleans pass (``as_plain`` makes them Python's)."""
    reward_part = result.reward_part
    if not isinstance(result.observation, str):
        return f"observation is {type(result.observation).__name__}, not text"
    if _is_flag(reward_part) or not isinstance(reward_part, numbers.Real) or not math.isfinite(reward_part):
        return f"reward_part is {reward_part!r}, not a finite number"
    for name in ("done", "tool_call", "tool_error"):
        if not _is_flag(getattr(result, name)):
            return f"{name} is {getattr(result, name)!r}, not true or false"
    if not isinstance(result.info, dict):
        return f"info is {type(result.info).__name__}, not a mapping"
    return None


def as_plain(result: StepResult) -> StepResult:
    """``result`` (on the schema) with Python's float and bools in place of NumPy's."""
    flags = {name: bool(getattr(result, name)) for name in ("done", "tool_call", "tool_error")}
    return replace(result, reward_part=float(result.reward_part), **flags)


def _is_flag(value: object) -> bool:
    return isinstance(value, (bool, np.bool_))


class EnvironmentFailed(Exception):
    """One call of an environment failed; ``outcome`` is how its episode ends (env_error or timeout). ``refused``
    names a refusal that waiting will not fix (an HTTP environment's 401, 403, 404, TLS or DNS failure), "" else."""

    def __init__(self, outcome: Literal["env_error", "timeout"], reason: str, refused: str = ""):
        super().__init__(reason)
        self.outcome: Literal["env_error", "timeout"] = outcome
        self.refused = refused


class Environment(Protocol):
    def reset(self, task: Task) -> str: ...

    def step(self, turn: Turn) -> StepResult: ...


class ToolEnvironment:
    """A tool the model calls inline: a turn ending in ``<tag>input</tag>`` gets ``<result>output</result>``.

    A turn without a call ends the episode (the model answered). A call whose input the tool rejects is a tool
    error the model sees as ``<result>error: ...</result>``, so it can try again; the episode goes on."""

    tag = ""

    def reset(self, task: Task) -> str:
        return task.prompt

    def step(self, turn: Turn) -> StepResult:
        # The turn's last call: a turn ends on the closing tag, though its last token may reach past it.
        calls = re.findall(rf"<{self.tag}>(.*?)</{self.tag}>", turn.text, re.DOTALL)
        if not calls:
            return StepResult(done=True)
        try:
            output = self.run(calls[-1])
        except ToolError as error:
            return StepResult(observation=f"<result>error: {error}</result>", tool_call=True, tool_error=True)
        return StepResult(observation=f"<result>{output}</result>", tool_call=True)

    def run(self, source: str) -> str:
        raise NotImplementedError


class ToolError(ValueError):
    """The tool could not run this input; the text is what the model is shown."""


# The safe evaluator's bounds: enough for arithmetic word problems, too little to spend the machine.
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses; ToolError otherwise.

    Parsed with ``ast`` and walked node by node (never ``eval``): names, calls, attributes and every other
    construct are refused, an exponent above MAX_EXPONENT or a value above MAX_MAGNITUDE too."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression.strip()[:50]!r}") from None
    value = _evaluate(tree.body)
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _evaluate(node: ast.expr) -> int | float:
    # A number, not a bool (True is an int too): the parser gives plain ints and floats.
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        if abs(node.value) > MAX_MAGNITUDE:
            raise ToolError(f"number above {MAX_MAGNITUDE:g}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is above {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"result above {MAX_MAGNITUDE:g}") from None
        if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
            raise ToolError(f"result above {MAX_MAGNITUDE:g} or not a real number")
        return value
    raise ToolError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


class Calculator(ToolEnvironment):
    """``<calc>12*(3+4)</calc>`` -> ``<result>84</result>``."""

    tag = "calc"

    def run(self, source: str) -> str:
        value = evaluate_arithmetic(source)
        return str(value) if isinstance(value, int) else f"{value:.6g}"


# The Python tool's limits: a fresh interpreter per call, in a box of its own (services/common/sandbox), killed past
# them. CPU seconds past the wall clock's limit: a busy single thread meets the wall clock first and is reported as
# running too long; threads burning several cores at once meet this one first.
PYTHON_LIMITS = BoxLimits(
    time_s=5.0,
    address_space_bytes=512 << 20,
    cpu_s=6,
    file_bytes=1 << 20,  # any one file, the output included: read back whole, so it must stay small
    open_files=64,
    processes=16,
    tmp_bytes=16 << 20,
)
PYTHON_OUTPUT_CHARS = 500
PythonIsolation = Literal["required", "allow_unisolated"]


def run_python(code: str, box: Box | None = None) -> str:
    """What ``code`` prints, run by ``box`` (by default a box under PYTHON_LIMITS: new user, PID, network and mount
    namespaces, an empty environment, a private /tmp; docs/agents.md, "The box"); ToolError when it fails (its last
    error line), runs past the time limit, is killed (CPU time, memory) or writes more than the per-file bound.
    BoxFailed, not a ToolError, when the box itself could not run it: the environment's fault, not the model's."""
    box = box or Box(PYTHON_LIMITS)
    outcome = box.run(code)
    if outcome.timed_out:
        raise ToolError(f"the code ran past {box.limits.time_s:g}s")
    if outcome.signal == signal.SIGSYS:  # the box's system-call filter kills a call made through another ABI
        raise ToolError("the code was killed (SIGSYS): it made a system call the box forbids")
    if outcome.signal is not None:  # killed by the kernel: the CPU limit (SIGXCPU, then SIGKILL), or out of memory
        killed = signal.Signals(outcome.signal).name if outcome.signal in signal.valid_signals() else outcome.signal
        raise ToolError(f"the code was killed ({killed}): past {box.limits.cpu_s}s of CPU time or out of memory")
    if outcome.exit_status != 0:
        lines = outcome.stderr.strip().splitlines() or [f"exit status {outcome.exit_status}"]
        raise ToolError(lines[-1][:PYTHON_OUTPUT_CHARS])
    return outcome.stdout.strip()[:PYTHON_OUTPUT_CHARS]


class PythonTool(ToolEnvironment):
    """``<python>print(2**10)</python>`` -> ``<result>1024</result>``, the code run by ``run_python`` in ``box``
    (a box under PYTHON_LIMITS unless given: ``python_tool`` gives the one a config asks for)."""

    tag = "python"

    def __init__(self, box: Box | None = None):
        self.box = box or Box(PYTHON_LIMITS)

    def run(self, source: str) -> str:
        return run_python(source, self.box)


@functools.cache
def box_available() -> str | None:
    """``sandbox.probe()``, once per process: None when a box can be built here, else why not."""
    return probe()


def python_tool(
    isolation: PythonIsolation, probe_box: Callable[[], str | None] = box_available
) -> Callable[[], PythonTool]:
    """What makes the Python tool of a run whose ``rollout.python_tool_isolation`` is ``isolation``, decided at
    start: tools in a box where ``probe_box`` finds one can be built; else StartRefused saying why, or, where the
    config allows it, tools in a plain child process, said once as a ``python_tool_unisolated`` warning."""
    reason = probe_box()
    if reason is None:
        box = Box(PYTHON_LIMITS)
    elif isolation == "required":
        raise StartRefused(
            f"the python environment runs model-written code only in a box, and none can be built here: {reason}. "
            "It needs unprivileged user namespaces (a container's seccomp profile must permit unshare) on x86_64 or "
            'aarch64 (docs/agents.md, "The box"); provide them, or set '
            "rollout.python_tool_isolation: allow_unisolated to run it unboxed (it can then read this process's "
            "environment and files and reach the network)"
        )
    else:
        box = Box(PYTHON_LIMITS, isolated=False)
        log_event(log, Event.PYTHON_TOOL_UNISOLATED, level=logging.WARNING, reason=reason)
    return functools.partial(PythonTool, box)


class NoTool:
    """No tool at all: the episode ends after the model's first turn, whatever it wrote. With ``max_turns: 1`` and
    no ``turn_stop`` it is the single-turn run of a tool task, measured by the same episode evaluation and reward as
    the run with the tool (examples/tool-arith-no-tool.yaml): the fair baseline of an ablation."""

    def reset(self, task: Task) -> str:
        return task.prompt

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


BUILT_IN: dict[str, Callable[[], Environment]] = {"calculator": Calculator, "python": PythonTool, "no-tool": NoTool}
assert set(BUILT_IN) == set(ENVIRONMENTS), "registry.ENVIRONMENTS names exactly the built-in environments"


def environment_factory(name: str) -> Callable[[], Environment]:
    """What makes one episode's environment: a built-in's class, or the plugin class ``module:Class`` names."""
    return BUILT_IN[name] if name in BUILT_IN else import_function(name)
