"""What an engine returns for one sample: the text, its token ids and their sampling logprobs, and why it ended.

It lives here, not with the engines, because the episode loop (run by the rollout and replayed by the trainer's
held-out evaluation) consumes it from either side's engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.transport.messages import Completion


@dataclass
class Generation:
    text: str
    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    finish_reason: str  # "stop" | "length"
    # The policy version of the weights that sampled it, where the caller knows it (the rollout's PolicyFollower
    # sets it); None from an engine alone and in the trainer's evaluation.
    policy_version: int | None = None

    def completion(self) -> Completion:
        """The sample as a single-turn completion (every token of its group's version)."""
        return Completion(
            text=self.text,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason="stop" if self.finish_reason == "stop" else "length",
        )
