"""Where training stands, as one typed record the trainer's components share.

The training loop advances it, recovery replaces it when it adopts a checkpoint, and
status, alerts and checkpoints read it. Components hold a reference to the same
``Progress``, never to the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.common.config import RunConfig


class ConfigSource(Protocol):
    """Whatever holds the config in force (``LiveConfig``): components read it when they act, never copy it."""

    cfg: RunConfig
    version: int


@dataclass
class Progress:
    step: int = 0
    version: int = 0  # the policy version the trainer serves; only grows, across restarts too
    applied_seq: int = 0  # every EXPERIENCE message up to here is applied, dropped or dead-lettered
    dead_seq: int = 0  # every DEAD message up to here has been read: its group settled as dead, or reopened
    saved_step: int = 0  # the newest step stored in the checkpoint store
    last_eval: float | None = None
    baseline_eval: float | None = None
    incarnation: str = ""  # this run's checkpoint lineage; written into every manifest
    abandoned_versions: list[tuple[int, int]] = field(default_factory=list)  # inclusive ranges nobody may train on
    last_row: dict[str, float] = field(default_factory=dict)  # the newest step's metrics, kept in checkpoints

    def disowned(self, policy_version: int) -> bool:
        """Whether a resume or rollback abandoned the steps that produced ``policy_version``."""
        return any(low <= policy_version <= high for low, high in self.abandoned_versions)
