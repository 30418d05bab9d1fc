"""What two runs of one ``train.deterministic`` config must repeat exactly in their metrics rows, and what not.

A row's values are of two kinds. Results follow from the config, the data and the seed: rewards, losses, KL,
lengths, gradient norms, evaluations, group counts; a reproducible run repeats each bit for bit. Readings measure
the machine and the moment: the wall clock and every duration or rate (``time``, ``time/*``, any key ending in
``_s`` such as ``step_time_s``, ``tokens_per_s``, ``eval_time_s``, ``checkpoint_time_s``, ``weights/offer_s``, or
naming seconds such as ``agent/env_seconds_mean``), memory and devices (``memory/*``, ``gpu/*``), the disk
(``disk_free_saves``) and the pipeline's health as the trainer last saw it (``services_down``, ``roles_stalled``,
``role_restarts``, and the roles' time shares ``share/*``). ``comparable`` keeps the results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from services.common.observe.records import MetricsRow

READING_PREFIXES = ("time/", "memory/", "gpu/", "share/")
READING_KEYS = frozenset({"time", "disk_free_saves", "services_down", "roles_stalled", "role_restarts"})


def is_reading(key: str) -> bool:
    """Whether a metrics-row key measures the machine or the moment rather than the run's results."""
    return key in READING_KEYS or key.startswith(READING_PREFIXES) or key.endswith("_s") or "seconds" in key


def comparable(row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` without its readings: what a rerun of a reproducible run must repeat exactly."""
    return {key: value for key, value in row.items() if not is_reading(key)}


def row_differences(first: Sequence[MetricsRow], second: Sequence[MetricsRow]) -> list[str]:
    """Where two runs' metrics rows differ, readings aside: one line per differing row or key; none when equal.
    NaN equals NaN here (a skipped step's loss is NaN in both)."""
    if len(first) != len(second):
        return [f"{len(first)} rows against {len(second)}"]
    differences = []
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        a, b = comparable(a.raw), comparable(b.raw)
        for key in sorted(a.keys() | b.keys()):
            x, y = a.get(key), b.get(key)
            if x != y and not (x != x and y != y):  # NaN != NaN
                differences.append(f"row {index} (step {a.get('step')}): {key} {x!r} != {y!r}")
    return differences
