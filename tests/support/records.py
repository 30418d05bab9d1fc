"""A run's records written by hand: JSON lines as the trainer and the launcher write them, at a fixed clock."""

from __future__ import annotations

import json
from pathlib import Path

# The clock of hand-written rows: a fixed moment, so that times in a test's rows and its expectations agree.
T0 = 1_700_000_000.0


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON lines at ``path``, as metrics.jsonl and events.jsonl hold them."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
