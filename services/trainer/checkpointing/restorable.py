"""What a checkpoint captures and an adoption restores: the trainer's components that the checkpointer and the
adopter both act on (recovery.py wires them once)."""

from __future__ import annotations

from dataclasses import dataclass

from services.trainer.checkpointing.lineage import Lineage
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.intake.feeder import PromptFeeder
from services.trainer.intake.ledger import GroupLedger
from services.trainer.learning.learner import Learner
from services.trainer.progress import ConfigSource, Progress


@dataclass(frozen=True)
class Restorable:
    settings: ConfigSource  # the config in force, read when a part acts
    learner: Learner
    checkpoints: CheckpointStore
    lineage: Lineage
    progress: Progress  # read by both parts; recovery.py puts what they return in force
    ledger: GroupLedger
    feeder: PromptFeeder
