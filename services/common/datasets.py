"""Arithmetic prompt/answer datasets stored as JSON Lines.

Every row is a JSON object with at least a ``prompt`` and an ``answer`` string,
e.g. ``{"id": "add-0037-0045", "prompt": "37+45=", "answer": "82"}``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

MAX_OPERAND = 99
SPLIT_NAMES = ("train", "dev", "eval")


def _addition_problem(a: int, b: int) -> dict:
    return {"id": f"add-{a:04d}-{b:04d}", "prompt": f"{a}+{b}=", "answer": str(a + b)}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def make_arithmetic_dataset(out_dir: Path, seed: int = 0, n_eval: int = 500, n_dev: int = 300) -> dict[str, Path]:
    """Write every addition a+b (0 <= a, b <= 99) as train/dev/eval JSONL splits.

    The 10,000 problems are shuffled with ``seed``, so the same seed always
    yields the same splits. ``eval`` is held out for measuring the trained
    policy, ``dev`` decides when the supervised warm start stops, and
    ``train`` holds the rest.

    Returns the path of each split file, keyed by split name.
    """
    n_problems = (MAX_OPERAND + 1) ** 2
    if n_eval < 0 or n_dev < 0 or n_eval + n_dev >= n_problems:
        raise ValueError(
            f"n_eval={n_eval} and n_dev={n_dev} must be non-negative and leave "
            f"training rows out of {n_problems} problems"
        )

    problems = [_addition_problem(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    # A private Random keeps the split independent of global random state.
    random.Random(seed).shuffle(problems)
    splits = {
        "eval": problems[:n_eval],
        "dev": problems[n_eval : n_eval + n_dev],
        "train": problems[n_eval + n_dev :],
    }

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in SPLIT_NAMES:
        paths[name] = out_dir / f"{name}.jsonl"
        _write_jsonl(paths[name], splits[name])
    return paths


def row_problem(raw: bytes) -> str | None:
    """Why one JSON Lines line is not a prompt/answer row, or None when it is one."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8"
    except json.JSONDecodeError as err:
        return f"invalid JSON ({err.msg})"
    if not isinstance(row, dict):
        return "not a JSON object"
    for field in ("prompt", "answer"):
        if not isinstance(row.get(field), str):
            return f"missing or non-string field {field!r}"
    return None


def load_jsonl(path: Path) -> list[dict]:
    """Read prompt/answer rows from a JSON Lines file, skipping blank lines.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file and 1-based line number of the first line
            that is not a JSON object with string ``prompt`` and ``answer``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")

    rows = []
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            problem = row_problem(line)
            if problem is not None:
                raise ValueError(f"{path}:{line_number}: {problem}")
            rows.append(json.loads(line))
    return rows
