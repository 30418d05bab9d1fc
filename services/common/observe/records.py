"""Typed readers of a run's record: ``metrics.jsonl`` rows as ``MetricsRow``, ``events.jsonl`` lines as
``EventRecord``.

A row is read through the metrics contract (services/common/observe/metrics.py): ``row.get(REWARD_MEAN)`` takes a
declared ``Metric``, never a free string, so a reader cannot ask for a key nobody writes, and renaming a key is one
edit. The row on disk is unchanged; ``MetricsRow.raw`` is it, as parsed.

Both records roll into numbered parts past ``telemetry.jsonl_max_mib``: ``read_jsonl`` reads every part in order,
``JsonlFollower`` (services/common/observe/logs.py) follows them; ``metrics_rows`` and ``event_records`` type what
either returns.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.observe import metrics as m
from services.common.observe.events import Event
from services.common.observe.logs import jsonl_parts
from services.common.observe.metric_types import Family, Metric


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines record, its rolled parts first (``jsonl_parts``); [] when it is
    missing. Lines that are not a JSON object are skipped, because a live run may be halfway through
    writing the last one."""
    rows = []
    for line in (line for part in jsonl_parts(path) for line in part.read_text().splitlines()):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _number(value: Any) -> float | None:
    """``value`` when it is a number (NaN and infinity included; a bool is not one), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


@dataclass(frozen=True)
class MetricsRow:
    """One row of ``metrics.jsonl``: a step row (it carries ``reward_mean``), an eval row (``eval_accuracy``), a
    checkpoint row or an alert row. Values are read by declared ``Metric``; a value that is absent or not a number
    reads as None."""

    raw: Mapping[str, Any]  # the row as parsed from its line

    def __contains__(self, metric: Metric) -> bool:
        return metric.key in self.raw

    def get(self, metric: Metric) -> float | None:
        """The number under ``metric`` (an int stays an int), or None."""
        return _number(self.raw.get(metric.key))

    def finite(self, metric: Metric) -> float | None:
        """The number under ``metric`` when it is finite, else None."""
        value = self.get(metric)
        return value if value is not None and math.isfinite(value) else None

    def __getitem__(self, metric: Metric) -> float:
        value = self.get(metric)
        if value is None:
            raise KeyError(f"the row has no number under {metric.key!r}")
        return value

    def text(self, metric: Metric) -> str | None:
        """The string under a ``Kind.TEXT`` metric (the alert's rule, a failed save's error), or None."""
        value = self.raw.get(metric.key)
        return value if isinstance(value, str) else None

    def family(self, family: Family) -> dict[tuple[str, ...], float]:
        """The numbers of ``family``'s members in the row, by their placeholders' values:
        ``{("gsm8k",): 0.5}`` for ``reward/gsm8k/mean``."""
        found = {}
        for key, value in self.raw.items():
            parts = family.parts(key)
            if parts is not None and (number := _number(value)) is not None:
                found[parts] = number
        return found

    def numbers(self) -> Iterator[tuple[str, float]]:
        """Every number of the row by its key, ``time`` and ``step`` included: what the trackers log."""
        for key, value in self.raw.items():
            number = _number(value)
            if number is not None:
                yield key, number

    @property
    def step(self) -> int | None:
        value = self.raw.get(m.STEP.key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def time(self) -> float | None:
        return self.finite(m.TIME)

    @property
    def is_step(self) -> bool:
        """A training step's row: every one carries the batch's reward."""
        return m.REWARD_MEAN in self

    @property
    def is_eval(self) -> bool:
        return m.EVAL_ACCURACY in self

    @property
    def alert(self) -> str | None:
        """The rule an alert row says fired."""
        return self.text(m.ALERT)


def metrics_rows(rows: Iterable[Mapping[str, Any]]) -> list[MetricsRow]:
    return [MetricsRow(row) for row in rows]


def read_metrics(path: Path) -> list[MetricsRow]:
    """Every row of a ``metrics.jsonl`` record (its rolled parts first); [] when there is none."""
    return metrics_rows(read_jsonl(path))


def step_rows(rows: Iterable[MetricsRow]) -> list[MetricsRow]:
    """The training steps' rows of ``rows``, in order."""
    return [row for row in rows if row.is_step and row.step is not None]


# -- events ---------------------------------------------------------------------------------------------------------

# The fields every line of events.jsonl has (EventLog.write); the rest are the event's own.
EVENT_FIELDS = ("time", "step", "kind", "message")


@dataclass(frozen=True)
class EventRecord:
    """One line of ``events.jsonl``: ``kind`` is the ``Event`` it was recorded as (``RECORDED_AS``), or the string
    found where a newer or older rlpipe wrote a kind this one does not know; ``details`` are the event's own fields
    (an alert's ``rule`` and ``severity``, a done's ``steps``)."""

    kind: Event | str
    message: str = ""
    time: float | None = None
    step: int | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, line: Mapping[str, Any]) -> EventRecord:
        kind = str(line.get("kind", ""))
        step = line.get("step")
        return cls(
            kind=Event(kind) if kind in Event._value2member_map_ else kind,
            message=str(line.get("message") or ""),
            time=_number(line.get("time")),
            step=step if isinstance(step, int) and not isinstance(step, bool) else None,
            details={key: value for key, value in line.items() if key not in EVENT_FIELDS},
        )

    @property
    def rule(self) -> str | None:
        """The alert rule an ``alert`` event names."""
        rule = self.details.get("rule")
        return rule if isinstance(rule, str) else None


@dataclass(frozen=True)
class RunDone:
    """The trainer's ``done`` event: how many steps the run made and its held-out accuracy before and after
    (None without an evaluation set); ``stopped_by`` says why a run stopped before its last step."""

    steps: int
    baseline_accuracy: float | None = None
    final_accuracy: float | None = None
    stopped_by: str = ""

    @classmethod
    def of(cls, event: EventRecord) -> RunDone:
        details = event.details
        stopped_by = details.get("stopped_by")
        return cls(
            steps=int(details.get("steps") or 0),
            baseline_accuracy=_number(details.get("baseline_accuracy")),
            final_accuracy=_number(details.get("final_accuracy")),
            stopped_by=stopped_by if isinstance(stopped_by, str) else "",
        )

    @property
    def accuracy_gain(self) -> float | None:
        if self.baseline_accuracy is None or self.final_accuracy is None:
            return None
        return self.final_accuracy - self.baseline_accuracy


def event_records(lines: Iterable[Mapping[str, Any]]) -> list[EventRecord]:
    return [EventRecord.of(line) for line in lines]


def read_events(path: Path) -> list[EventRecord]:
    """Every event of an ``events.jsonl`` record (its rolled parts first); [] when there is none."""
    return event_records(read_jsonl(path))
