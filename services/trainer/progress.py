"""Where training stands, as one typed record the trainer's components share.

Components hold a reference to the same ``Progress``, never to the loop. They read its fields freely and change
them only through its methods, each named after the fact that moves them, so every field has one writer:

- ``started`` (a fresh start) and ``adopt`` (a resume, a restart without a checkpoint, a rollback): recovery;
- ``advance``, ``evaluated``, ``reported``: the training loop (service.py);
- ``saved``: the checkpointer, once a save is stored;
- ``read_dead``: the intake, as it reads DEAD.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.common.config import RunConfig


class ConfigSource(Protocol):
    """Whatever holds the config in force (``LiveConfig``): components read it when they act, never copy it."""

    @property
    def cfg(self) -> RunConfig: ...

    @property
    def version(self) -> int: ...


@dataclass(frozen=True)
class ProcessState:
    """What only a new process takes over from a checkpoint: a rollback keeps the running process's."""

    dead_seq: int
    baseline_eval: float | None
    last_row: dict[str, float]


@dataclass(frozen=True)
class Adopted:
    """Where training goes on from after a stored step is adopted (or a restart found none to adopt)."""

    step: int
    version: int
    applied_seq: int
    incarnation: str
    last_eval: float | None
    abandoned_versions: list[tuple[int, int]]
    process: ProcessState | None = None  # a resume's; None for a rollback


@dataclass
class Progress:
    step: int = 0
    version: int = 0  # the policy version the trainer serves; only grows, across restarts too
    applied_seq: int = 0  # every EXPERIENCE message up to here is applied, dropped or dead-lettered
    dead_seq: int = 0  # every DEAD message up to here has been read: its group settled as dead, or reopened
    saved_step: int = 0  # the newest step stored in the checkpoint store
    # Whether saved_step's stored copy holds all the learner would save (not a periodic save that left out the
    # optimizer state, checkpoint.optimizer_every): a save at a stop or on request must keep it.
    saved_whole: bool = True
    last_eval: float | None = None
    baseline_eval: float | None = None
    incarnation: str = ""  # this run's checkpoint lineage; written into every manifest
    abandoned_versions: list[tuple[int, int]] = field(default_factory=list)  # inclusive ranges nobody may train on
    last_row: dict[str, float] = field(default_factory=dict)  # the newest step's metrics, kept in checkpoints

    def disowned(self, policy_version: int) -> bool:
        """Whether a resume or rollback abandoned the steps that produced ``policy_version``."""
        return any(low <= policy_version <= high for low, high in self.abandoned_versions)

    def started(self, incarnation: str) -> None:
        """A fresh start as ``incarnation``."""
        self.incarnation = incarnation

    def adopt(self, adopted: Adopted) -> None:
        """Go on from ``adopted``: the adopted step is the newest one stored."""
        self.step = self.saved_step = adopted.step
        self.saved_whole = True  # without optimizer state in the step, the learner's starts fresh: nothing to add
        self.version = adopted.version
        self.applied_seq = adopted.applied_seq
        self.incarnation = adopted.incarnation
        self.last_eval = adopted.last_eval
        self.abandoned_versions = list(adopted.abandoned_versions)
        if adopted.process is not None:
            self.dead_seq = adopted.process.dead_seq
            self.baseline_eval = adopted.process.baseline_eval
            self.last_row = dict(adopted.process.last_row)

    def advance(self, applied_seq: int) -> None:
        """A step applied the EXPERIENCE read through ``applied_seq``: a new step and policy version."""
        self.step += 1
        self.version += 1
        self.applied_seq = applied_seq

    def evaluated(self, accuracy: float | None, baseline: bool = False) -> None:
        """Held-out accuracy now; ``baseline``: before the first step, the figure later ones are judged against."""
        if baseline:
            self.baseline_eval = accuracy
        else:
            self.last_eval = accuracy

    def reported(self, row: dict[str, float]) -> None:
        """The newest step's metrics row."""
        self.last_row = row

    def saved(self, step: int, whole: bool = True) -> None:
        """Step ``step`` is stored; ``whole``: with the optimizer state."""
        if step > self.saved_step:
            self.saved_step, self.saved_whole = step, whole
        elif step == self.saved_step:
            self.saved_whole = self.saved_whole or whole

    @property
    def saved_in_full(self) -> bool:
        """Whether the current step is stored with everything a save at a stop or on request keeps."""
        return self.saved_step == self.step and self.saved_whole

    def read_dead(self, seq: int) -> None:
        """DEAD is read through ``seq``."""
        self.dead_seq = seq
