"""A study's budget (``budget`` in the tune file), shared by every worker through the study itself: how many trials
were claimed, the wall time since the first claim, and the device-hours ended trials spent and running ones reserved."""

from __future__ import annotations

import time

import optuna

from services.tuner import records
from services.tuner.records import TrialRecord
from services.tuner.spec import TuneSpec


class StudyBudget:
    """What is left of ``spec.budget`` in ``study``; each call reads the study afresh (other workers spend it too)."""

    def __init__(self, spec: TuneSpec, study: optuna.Study):
        self.spec = spec
        self.study = study

    def started_at(self) -> float:
        """When the study's first trial was claimed, by any worker: the start of ``budget.max_wall_s``."""
        started = self.study.user_attrs.get("started_at")
        if started is None:
            started = time.time()
            self.study.set_user_attr("started_at", started)
        return float(started)

    @staticmethod
    def device_hours_spent(all_records: list[TrialRecord]) -> float:
        """Ended trials' device-hours, and what running ones reserved (their deadline times their GPUs)."""
        spent = 0.0
        for r in all_records:
            if r.end is not None:
                spent += r.end.device_hours
            elif r.status == "running" and r.start is not None:
                spent += r.start.reserved_device_hours
        return spent

    def spent(self) -> str:
        """Which limit stops the next trial from starting (empty while none does); called under the claim lock."""
        all_records = records.records(self.study)
        # Every trial claimed, running or ended, by any worker; not enqueued ones still waiting, nor duplicates.
        counted = sum(1 for r in all_records if r.state != "WAITING" and r.status != "duplicate")
        b = self.spec.budget
        if counted >= b.max_trials:
            return f"budget.max_trials ({b.max_trials}) reached"
        if b.max_wall_s is not None and time.time() - self.started_at() >= b.max_wall_s:
            return f"budget.max_wall_s ({b.max_wall_s:g}s) reached"
        if b.max_device_hours is not None and self.device_hours_spent(all_records) >= b.max_device_hours:
            return f"budget.max_device_hours ({b.max_device_hours:g}) reached"
        return ""

    def deadline(self, gpus: int) -> tuple[float, str]:
        """Wall seconds the next trial may run, and which limit that is; called under the claim lock."""
        options = [(self.spec.trial.max_wall_s, "trial.max_wall_s")]
        b = self.spec.budget
        if b.max_wall_s is not None:
            options.append((b.max_wall_s - (time.time() - self.started_at()), "budget.max_wall_s"))
        if b.max_device_hours is not None:
            left_h = b.max_device_hours - self.device_hours_spent(records.records(self.study))
            options.append((left_h * 3600 / max(gpus, 1), "budget.max_device_hours"))
        return min(options)
