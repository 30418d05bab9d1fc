"""docs/metrics.md's table of row keys, generated from the metrics contract (services/common/observe/metrics.py):
``python -m services.common.observe.metrics_reference`` rewrites the section between the two markers in place and
leaves the prose around it as it is (`make metrics-reference`).

A unit test fails while the checked-in section differs from what ``render`` gives, so the table cannot drift from
the declarations.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from services.common.observe.metric_types import Family, Group, Kind, Metric, gauge_name
from services.common.observe.metrics import DECLARED

BEGIN = (
    "<!-- generated from services/common/observe/metrics.py by "
    "`python -m services.common.observe.metrics_reference`: edit the declarations, not this table -->"
)
END = "<!-- end of the generated table -->"
DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
PREFIX = gauge_name("")
HEADER = "| row key | kind | unit | tracker name | Prometheus (trainer) | meaning |"


def _tracker(declared: Metric | Family) -> str:
    if declared.kind in (Kind.INDEX, Kind.TEXT):
        return "—"  # a row's place or a name, never logged as a number
    if isinstance(declared, Family):
        return "same"  # a family's keys all hold a "/", which the trackers keep
    return "same" if declared.tracker_name == declared.key else f"`{declared.tracker_name}`"


def _gauge(declared: Metric | Family) -> str:
    if not declared.exported:
        return ""
    if isinstance(declared, Metric):
        return f"`{declared.gauge_name}`"
    # The pattern's literal parts as a gauge name, its placeholders kept: rlpipe_trainer_time_<phase>_s.
    pieces = re.split(r"(<[a-z_]+>)", declared.pattern)
    name = "".join(piece if piece.startswith("<") else gauge_name(piece).removeprefix(PREFIX) for piece in pieces)
    return f"`{PREFIX}{name}`"


def _meaning(declared: Metric | Family) -> str:
    if isinstance(declared, Family) and declared.values is not None:
        [placeholder] = declared.placeholders
        return f"{declared.description}; `<{placeholder}>`: {', '.join(declared.values)}"
    return declared.description


def _line(declared: Metric | Family) -> str:
    key = declared.key if isinstance(declared, Metric) else declared.pattern
    cells = (f"`{key}`", declared.kind, declared.unit, _tracker(declared), _gauge(declared), _meaning(declared))
    return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"


def render() -> str:
    """The generated section, markers included: one table per ``Group``, in declaration order."""
    parts = [BEGIN]
    for group in Group:
        declared = [d for d in DECLARED if d.group == group]
        if declared:
            parts += ["", f"### {group}", "", HEADER, "| --- | --- | --- | --- | --- | --- |"]
            parts += [_line(d) for d in declared]
    return "\n".join([*parts, "", END])


def section(text: str) -> str:
    """The generated section of a docs/metrics.md text, markers included; ValueError without its markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no generated section: the file needs the lines {BEGIN!r} and {END!r}")
    return text[start : end + len(END)]


def rewrite(path: Path = DOC) -> None:
    """Replace the generated section of ``path`` with ``render()``; the prose around it stays."""
    text = path.read_text()
    path.write_text(text.replace(section(text), render()))


if __name__ == "__main__":
    rewrite(Path(sys.argv[1]) if len(sys.argv) > 1 else DOC)
