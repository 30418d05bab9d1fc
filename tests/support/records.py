"""A run's records written by hand: JSON lines as the trainer and the launcher write them, at a fixed clock, and
the report's page over them."""

from __future__ import annotations

import json
from pathlib import Path

# The clock of hand-written rows: a fixed moment, so that times in a test's rows and its expectations agree.
T0 = 1_700_000_000.0


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON lines at ``path``, as metrics.jsonl and events.jsonl hold them."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def report_section(run_dir: Path, rows: list[dict], heading: str) -> str:
    """The section under ``heading`` of the HTML report of a run folder whose metrics are ``rows``."""
    from services.cli.report import render_html

    run_dir.mkdir(exist_ok=True)
    write_jsonl(run_dir / "metrics.jsonl", rows)
    return render_html(run_dir).read_text().split(f"<h2>{heading}</h2>")[1].split("<h2>")[0]
