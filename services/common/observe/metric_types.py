"""The vocabulary the metrics contract (``services/common/observe/metrics.py``) is declared in: what a value
measures (``Kind``), where it comes from (``Group``), one row key (``Metric``) or a pattern of keys (``Family``), and
the names derived from a key for Prometheus and the experiment trackers."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    """What a value measures; the trackers and Prometheus take all three numeric kinds as a value at a step."""

    GAUGE = "gauge"  # a level at the row's step: a loss, a length, memory in use
    COUNTER = "counter"  # a count: things that happened in the interval the row covers, or a version that only grows
    RATE = "rate"  # a share in [0, 1] of something in the step, or an amount per second
    INDEX = "index"  # where the row sits (its time, its step): every value is logged at it, never as a metric
    TEXT = "text"  # a name or a reason (the alert rule, a failed save's error): carried, never plotted


class Group(StrEnum):
    """Where a metric comes from; the value is docs/metrics.md's heading."""

    ROW = "Every row"
    POLICY = "Policy update (the learner's step)"
    CRITIC = "Critic (PPO)"
    BATCH = "The step's batch"
    TIME = "Time and throughput"
    PIPELINE = "Pipeline health (the group ledger, services, disk)"
    AGENT = "Multi-turn episodes (absent without episodes)"
    HARDWARE = "Memory and GPU"
    NETWORK = "Network (the trainer's own traffic)"
    EVAL = "Held-out evaluation (eval rows)"
    CHECKPOINT = "Checkpoints (save rows)"
    ALERT = "Alerts (alert rows)"


_PLACEHOLDER = re.compile(r"<([a-z_]+)>")


def gauge_name(key: str) -> str:
    """The Prometheus name of a step-row key's gauge: ``rlpipe_trainer_`` + the key, each character Prometheus
    does not allow in a name (the ``/`` of ``memory/peak_gb``) as ``_``: ``rlpipe_trainer_memory_peak_gb``."""
    return "rlpipe_trainer_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def default_tracker_name(key: str) -> str:
    """A key that already has a namespace keeps it in the trackers; any other goes under ``trainer/``."""
    return key if "/" in key else f"trainer/{key}"


@dataclass(frozen=True)
class Metric:
    """One row key. ``tracker``: its experiment-tracker name (empty: ``default_tracker_name``); ``exported``: the
    trainer sets the gauge ``gauge_name(key)`` from each step row that carries it."""

    key: str
    group: Group
    kind: Kind
    unit: str
    description: str
    tracker: str = ""
    exported: bool = False

    @property
    def tracker_name(self) -> str:
        return self.tracker or default_tracker_name(self.key)

    @property
    def gauge_name(self) -> str:
        return gauge_name(self.key)


@dataclass(frozen=True)
class Family:
    """Row keys made from one pattern, ``reward/<fn>/mean``: each ``<name>`` stands for one path segment. With
    ``values`` (one placeholder only) the family is closed to them; ``exported`` exports each value's key."""

    pattern: str
    group: Group
    kind: Kind
    unit: str
    description: str
    values: tuple[str, ...] | None = None
    exported: bool = False

    def __post_init__(self) -> None:
        if self.values is not None and len(self.placeholders) != 1:
            raise ValueError(f"{self.pattern}: a closed family has exactly one placeholder")

    @property
    def placeholders(self) -> list[str]:
        return _PLACEHOLDER.findall(self.pattern)

    @functools.cached_property
    def regex(self) -> re.Pattern[str]:
        # re.escape leaves "<", ">" and the placeholder names as they are.
        return re.compile(_PLACEHOLDER.sub("([^/]+)", re.escape(self.pattern)))

    def of(self, *parts: str) -> Metric:
        """The member whose placeholders are ``parts``: ``REWARD_PART.of("gsm8k")`` is ``reward/gsm8k/mean``."""
        names = self.placeholders
        if len(parts) != len(names) or (self.values is not None and parts[0] not in self.values):
            raise ValueError(f"{self.pattern} has no member {'/'.join(parts)!r}")
        key = self.pattern
        for name, part in zip(names, parts, strict=True):
            key = key.replace(f"<{name}>", part, 1)
        return Metric(key, self.group, self.kind, self.unit, self.description, exported=self.exported)

    def parts(self, key: str) -> tuple[str, ...] | None:
        """The placeholders' values of ``key`` when it is a member, else None."""
        found = self.regex.fullmatch(key)
        if found is None or (self.values is not None and found.group(1) not in self.values):
            return None
        return found.groups()

    def value(self, metric: Metric) -> str:
        """The placeholder's value of a member of a one-placeholder family: ``wait`` for ``time/wait_s``."""
        parts = self.parts(metric.key)
        if parts is None or len(parts) != 1:
            raise ValueError(f"{metric.key} is not a member of {self.pattern} with one placeholder")
        return parts[0]

    def members(self) -> list[Metric]:
        """A closed family's members, in the order of ``values``."""
        return [self.of(value) for value in self.values or ()]
