"""Parts of the trainer's step row that keep their own account: the ledger's counts since the last row, where the
time between two rows went, and what dynamic sampling left out."""

from __future__ import annotations

from services.common.config import TrainConfig
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.metrics import GROUPS_DEAD, GROUPS_LOST, GROUPS_REOPENED, IN_FLIGHT_GROUPS, REPEATS_DROPPED
from services.common.observe.timeshare import StageActivity, StepPhase, TimeShare
from services.trainer.intake.ledger import Fate, GroupLedger
from services.trainer.intake.reader import Collected

# The trainer's phases as the stages' activities: waiting for experience is idle, offering weights is blocked.
PHASE_ACTIVITY = {
    StepPhase.WAIT: StageActivity.IDLE,
    StepPhase.COMPUTE: StageActivity.BUSY,
    StepPhase.PUBLISH: StageActivity.BLOCKED,
    StepPhase.EVAL: StageActivity.BUSY,
    StepPhase.BOOKKEEPING: StageActivity.BUSY,
}


class LedgerRows:
    """The ledger's counts as metrics: each row says what changed since the one before."""

    def __init__(self, ledger: GroupLedger, telemetry: TrainerMetrics):
        self.ledger = ledger
        self.telemetry = telemetry
        self.reported: dict[str, int] = {}  # the ledger's counts as of the last metrics row

    def row(self) -> dict[str, float]:
        """Groups settled as dead or lost, reopened by a re-inject, and repeats refused since the last row; the
        groups in flight now."""
        counts = {
            GROUPS_DEAD.key: self.ledger.counts[Fate.DEAD],
            GROUPS_REOPENED.key: self.ledger.reopened,
            GROUPS_LOST.key: self.ledger.counts[Fate.LOST],
            REPEATS_DROPPED.key: self.ledger.repeats,
        }
        row = {name: float(n - self.reported.get(name, 0)) for name, n in counts.items()}
        self.reported = counts
        self.telemetry.record_groups("dead", int(row[GROUPS_DEAD.key]))
        self.telemetry.record_groups("reopened", int(row[GROUPS_REOPENED.key]))
        self.telemetry.record_groups("repeat", int(row[REPEATS_DROPPED.key]))
        return {**row, IN_FLIGHT_GROUPS.key: float(len(self.ledger.in_flight))}


def step_time_row(step_time: TimeShare, time_spent: dict[StageActivity, float]) -> dict[str, float]:
    """``time/<phase>_s`` for each phase since the last step row: together the wall time between the two rows; each
    phase's seconds are added to ``time_spent`` as the activity it counts as."""
    split = step_time.take()
    for phase, seconds in split.items():
        time_spent[PHASE_ACTIVITY[phase]] += seconds
    return {f"time/{phase}_s": round(seconds, 4) for phase, seconds in split.items()}


def dynamic_sampling_row(train: TrainConfig, collected: Collected) -> dict[str, float]:
    """What dynamic sampling left out of this step's batch; nothing while it is off."""
    if not train.dynamic_sampling:
        return {}
    return {
        "groups_filtered": float(len(collected.filtered)),
        "dynamic_sampling/dropped_fraction": collected.filtered_fraction,
    }
