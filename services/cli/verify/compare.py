"""What changed between two verifications: versions, config and figures (``rlpipe verify --against``).

A ``verify.json`` is the deployment's baseline (the guide's deployment record). After an upgrade or a config change
the question is what moved: which build and library versions, which settings, which checks flipped, and how the
smoke run's figures compare. Each verification keeps the record it replaces under ``verify-history/`` so that the
newest earlier record is always there to compare with. The comparison is pure: two records in, changes out.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HISTORY_DIR = "verify-history"
HISTORY_KEEP = 20  # earlier records kept beside verify.json, newest first
# A figure that moved less than this (relative) is noise between two smoke runs of a few steps.
FIGURE_TOLERANCE = 0.10


@dataclass(frozen=True)
class Change:
    """One thing that differs: a version, a setting, a check's result or a figure, before and after."""

    kind: str  # "version" | "config" | "check" | "figure"
    name: str
    before: Any
    after: Any

    def line(self) -> str:
        if self.kind == "figure" and isinstance(self.before, float) and isinstance(self.after, float):
            ratio = self.after / self.before if self.before else math.inf
            return f"{self.kind} {self.name}: {self.before:.4g} -> {self.after:.4g} ({ratio:.2f}x)"
        return f"{self.kind} {self.name}: {self.before} -> {self.after}"


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested mapping (``train.learning_rate``); lists are compared whole."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat(value, name + "."))
        else:
            flat[name] = value
    return flat


def _differences(kind: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> list[Change]:
    absent = "(absent)"
    return [
        Change(kind, name, before.get(name, absent), after.get(name, absent))
        for name in sorted(set(before) | set(after))
        if before.get(name, absent) != after.get(name, absent)
    ]


def figures(record: Mapping[str, Any]) -> dict[str, float]:
    """The median of each figure over the smoke run's steps (``first_run_metrics``), steps themselves left out."""
    by_key: dict[str, list[float]] = {}
    for row in record.get("first_run_metrics", []):
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                by_key.setdefault(key, []).append(float(value))
    return {key: statistics.median(values) for key, values in by_key.items()}


def compare(before: Mapping[str, Any], after: Mapping[str, Any], tolerance: float = FIGURE_TOLERANCE) -> list[Change]:
    """Every difference between the verification ``before`` and the later ``after``: build and library versions,
    config settings (as recorded, secrets redacted), checks whose result changed, and figures whose median moved by
    more than ``tolerance`` of the earlier one."""
    versions = _differences(
        "version",
        {**{f"build.{k}": v for k, v in before.get("build", {}).items()}, **before.get("libraries", {})},
        {**{f"build.{k}": v for k, v in after.get("build", {}).items()}, **after.get("libraries", {})},
    )
    config = _differences("config", _flat(before.get("config", {})), _flat(after.get("config", {})))
    checks = _differences(
        "check",
        {check["name"]: check["status"] for check in before.get("checks", [])},
        {check["name"]: check["status"] for check in after.get("checks", [])},
    )
    old, new = figures(before), figures(after)
    moved = [
        Change("figure", key, old[key], new[key])
        for key in sorted(set(old) & set(new))
        if abs(new[key] - old[key]) > tolerance * max(abs(old[key]), 1e-12)
    ]
    return [*versions, *config, *checks, *moved]


def keep_previous(record_path: Path, keep: int = HISTORY_KEEP) -> Path | None:
    """Move the ``verify.json`` about to be replaced into ``verify-history/`` (named by its own time), keep the
    newest ``keep`` there, and return where it went; None when there was none."""
    if not record_path.is_file():
        return None
    history = record_path.parent / HISTORY_DIR
    history.mkdir(exist_ok=True)
    try:
        stamp = json.loads(record_path.read_text())["time"].replace(":", "")
    except (ValueError, KeyError, TypeError, AttributeError):
        stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime(record_path.stat().st_mtime))
    kept = history / f"verify-{stamp}.json"
    record_path.replace(kept)
    for old in sorted(history.glob("verify-*.json"), reverse=True)[keep:]:
        old.unlink()
    return kept


def newest_earlier(record_path: Path) -> Path | None:
    """The newest record ``keep_previous`` kept beside ``record_path``, if any."""
    history = sorted((record_path.parent / HISTORY_DIR).glob("verify-*.json"), reverse=True)
    return history[0] if history else None


def record_changes(as_json: Path, as_md: Path, baseline: Path) -> list[Change]:
    """Compare the verification just written (``as_json``) with ``baseline``, and add what changed to both of its
    files: ``changes_since`` in the JSON, a section in the Markdown."""
    record = json.loads(as_json.read_text())
    changes = compare(json.loads(baseline.read_text()), record)
    record["changes_since"] = {
        "record": str(baseline),
        "changes": [{"kind": c.kind, "name": c.name, "before": c.before, "after": c.after} for c in changes],
    }
    as_json.write_text(json.dumps(record, indent=2) + "\n")
    lines = ["", f"## Changes since {baseline}", "", *(f"- {c.line()}" for c in changes or [])]
    if not changes:
        lines.append(f"- nothing changed beyond {FIGURE_TOLERANCE:.0%} in its figures")
    with as_md.open("a") as markdown:
        markdown.write("\n".join(lines) + "\n")
    return changes
