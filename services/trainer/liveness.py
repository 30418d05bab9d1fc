"""The trainer loop's heartbeat, which its gRPC health follows.

The loop beats each time round and, while it waits for groups, between two reads of EXPERIENCE
(every second or so), so an idle pipeline and an operator's pause (the loop goes round every
second while held) keep it beating. One learner step, one evaluation, an adopted checkpoint or
the final upload beats nothing while it runs: ``train.stall_bound_s`` must exceed the longest of
them. Past it the trainer's gRPC health (the weight-sync port Kubernetes probes, and the admin
port) reports NOT_SERVING, through the same watchdog as the stages'
(``services.common.service.watch_progress``), and SERVING again at the next beat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class LoopHeartbeat:
    bound_s: float  # train.stall_bound_s
    last_progress: float = field(default_factory=time.time)  # wall time of the last beat, as presence shows it

    def beat(self) -> None:
        self.last_progress = time.time()

    def stalled_for(self, now: float) -> float:
        """Seconds without a beat beyond ``bound_s`` (0 while the loop beats)."""
        return max(0.0, now - self.last_progress - self.bound_s)
