"""The PPO critic: a scalar value per response token, from its own model or from the policy's backbone."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from services.common.config import RunConfig
from services.common.model.modeling import ResponseBatch, at_response, enable_gradient_checkpointing, load_model


class Critic(torch.nn.Module):
    """V(s_t) for the state before each response token, read off the last hidden layer by a linear head.

    ``kind = "separate"``: a copy of the base model's backbone, trained only by the value loss.
    ``kind = "head"``: the head sits on the policy's own backbone and reuses the policy's
    forward pass, so the value loss also shapes the shared trunk.
    Its parameters take the policy's dtype (float32 with fp32 master weights); the learner moves it
    to the policy's device and runs it under the same autocast.
    """

    def __init__(self, cfg: RunConfig, policy: PreTrainedModel):
        super().__init__()
        self.kind = cfg.train.critic.kind
        hidden = policy.config.hidden_size
        if self.kind == "separate":
            self.backbone = load_model(cfg.model.folder, policy.dtype).model
            if cfg.train.gradient_checkpointing:
                enable_gradient_checkpointing(self.backbone)
        self.head = torch.nn.Linear(hidden, 1, dtype=policy.dtype)
        # A zero head starts every value at 0 instead of at noise, which would distort the first advantages.
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def values(self, batch: ResponseBatch, policy_output: Any) -> torch.Tensor:
        """``[B, R]`` values; ``policy_output`` must carry hidden states for the ``head`` kind."""
        if self.kind == "head":
            hidden = policy_output.hidden_states[-1]
        else:
            hidden = self.backbone(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
            ).last_hidden_state
        return self.head(at_response(hidden, batch)).squeeze(-1).float()
