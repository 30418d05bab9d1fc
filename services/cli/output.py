"""Where the CLI's tables go, so that they survive a pipe.

On a terminal rich fits a table to the window. Anywhere else (``rlpipe plan > plan.txt``, ``| grep``, a CI log) rich
would assume 80 columns and cut columns to "…"; a file or a pipe has no width, so there the tables print whole.
Scripts should not parse tables at all: the commands an operator scripts take ``--json``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console

# Wide enough for any table rlpipe prints; rich sizes a table to its content, so this only lifts the cut.
UNCUT_WIDTH = 10_000


def console_for(stream: TextIO | None = None) -> Console:
    """A console on ``stream`` (stdout by default) that fits a terminal and never cuts a table anywhere else."""
    stream = stream or sys.stdout
    if stream is None:  # an interpreter started without one (pythonw)
        raise RuntimeError("there is no standard output to print to")
    stderr = stream is sys.stderr
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(file=None if stderr else stream, stderr=stderr, width=UNCUT_WIDTH)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(item) for item in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value


def print_json(value: Any) -> None:
    """``value`` (dataclasses, dicts, lists, enums, paths, numbers) as one JSON document on stdout."""
    sys.stdout.write(json.dumps(_plain(value), indent=2) + "\n")
