"""A trainer step's batch: groups flattened to one row per completion, what its loss is measured against, how its
rows are cut into micro-batches, and the checks that keep non-finite numbers out of the weights. Pure tensors, no
model: each piece is tested alone (tests/trainer/learning/test_learner.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from services.common.transport.messages import ExperienceGroup


def _padded(rows: list[np.ndarray], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.from_numpy(np.asarray(row, dtype=np.float32))
    return out


def chunks_of(indices: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``indices`` in at most ``parts`` non-empty runs of equal count (the first ones one longer where it does not
    divide): mini-batches, or micro-batches without a token budget."""
    return [chunk for chunk in torch.tensor_split(indices, min(parts, len(indices))) if len(chunk)]


@dataclass
class Batch:
    """A batch of groups flattened to one row per completion, per-token tensors ``[N, R]``.

    ``mask`` is what every loss, advantage and statistic reads: 1 on the tokens the model sampled, 0 on padding
    and on the tokens an environment inserted into a multi-turn episode (``Completion.loss_mask``). ``filled`` is
    1 on every response token, the model's or the environment's: what the forward pass carries and lengths count.
    A single-turn completion has both equal, so its loss is exactly what it was before masks.
    """

    pairs: list[tuple[list[int], list[int]]]
    mask: torch.Tensor
    filled: torch.Tensor
    rollout_logp: torch.Tensor
    ref_logp: torch.Tensor
    rewards: torch.Tensor  # [N] scalar reward per completion
    group_index: torch.Tensor
    stopped: torch.Tensor  # 1.0 where generation ended on EOS
    policy_versions: torch.Tensor  # [N] the group's version: the newest that sampled a token of it
    token_versions: torch.Tensor  # [N, R] the version that sampled each response token

    @property
    def oldest_versions(self) -> torch.Tensor:
        """``[N]`` the oldest version among each row's sampled tokens (the group's for a row without any): the
        completion is as stale as it, as the intake's bound measures it (``RolloutGroup.oldest_version``)."""
        sampled = torch.where(self.mask > 0, self.token_versions, self.policy_versions[:, None])  # [N, R]
        return torch.minimum(sampled.amin(-1), self.policy_versions)

    @property
    def mixed_versions(self) -> torch.Tensor:
        """``[N]`` True where a row's sampled tokens came from more than one policy version (weights loaded while it
        was generated)."""
        sampled = self.mask > 0
        newest = torch.where(sampled, self.token_versions, -torch.inf).amax(-1)
        return sampled.any(-1) & (newest != self.oldest_versions)

    @property
    def lengths(self) -> torch.Tensor:
        """``[N]`` prompt + response length of each row, on the CPU (it only decides how rows are grouped)."""
        return torch.tensor([len(prompt) + len(response) for prompt, response in self.pairs])

    def to(self, device: torch.device) -> Batch:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "pairs"})

    @classmethod
    def of(cls, groups: list[ExperienceGroup]) -> Batch:
        rows = [
            (i, g, c, ref) for i, g in enumerate(groups) for c, ref in zip(g.completions, g.ref_logprobs, strict=False)
        ]
        pairs = [(g.prompt_ids.tolist(), c.token_ids.tolist()) for _, g, c, _ in rows]
        width = max(max(len(r) for _, r in pairs), 1)
        lengths = torch.tensor([len(r) for _, r in pairs])
        filled = (torch.arange(width)[None, :] < lengths[:, None]).float()
        loss_masks = [
            c.loss_mask if c.loss_mask is not None else np.ones(len(r))
            for (_, _, c, _), (_, r) in zip(rows, pairs, strict=True)
        ]
        return cls(
            pairs=pairs,
            mask=_padded(loss_masks, width),
            filled=filled,
            rollout_logp=_padded([c.logprobs for _, _, c, _ in rows], width),
            ref_logp=_padded([ref for *_, ref in rows], width),
            rewards=torch.tensor(np.concatenate([g.rewards for g in groups]), dtype=torch.float32),
            group_index=torch.tensor([i for i, *_ in rows]),
            stopped=torch.tensor([c.finish_reason == "stop" for _, _, c, _ in rows], dtype=torch.float32),
            policy_versions=torch.tensor([float(g.policy_version) for _, g, _, _ in rows]),
            token_versions=_padded([c.versions(g.policy_version) for _, g, c, _ in rows], width),
        )

    def token_rewards(self) -> torch.Tensor:
        """The scalar reward on each response's last token the model sampled (an episode may end on an
        observation, which no action of the model's follows)."""
        out = torch.zeros_like(self.mask)
        positions = torch.arange(self.mask.shape[1], device=self.mask.device, dtype=self.mask.dtype)
        last = (positions * self.mask).argmax(-1)
        out[torch.arange(len(out), device=out.device), last] = self.rewards * (self.mask.sum(-1) > 0)
        return out


@dataclass
class StepTargets:
    """What a step's loss is measured against, fixed before its first update; per-token ``[N, R]``."""

    old_logp: torch.Tensor  # pi_old of the ratio
    advantages: torch.Tensor
    old_values: torch.Tensor | None = None  # PPO: the critic before the update, for value clipping
    returns: torch.Tensor | None = None  # PPO: value targets
    # log rho = log pi_old - log pi_rollout on valid tokens (with old_logprobs: recompute; None otherwise), and the
    # off-policy correction's weights from it (train.off_policy; None without one, 0 on masked tokens).
    log_ratio: torch.Tensor | None = None
    weights: torch.Tensor | None = None


def non_finite_targets(targets: StepTargets, mask: torch.Tensor) -> str | None:
    """Why the step's targets cannot be trained on (a NaN or infinite advantage, logprob, return or weight on a
    response token), or None."""
    valid = mask.bool()
    for name in ("advantages", "old_logp", "returns", "weights"):
        values = getattr(targets, name)
        if values is not None and not bool(torch.isfinite(values[valid]).all()):
            return f"{name} are not finite"
    return None


def non_finite_update(loss: float, grad_norm: float) -> str | None:
    """Why an optimizer update must not be applied (its loss or gradient norm is NaN or infinite), or None."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    if not math.isfinite(grad_norm):
        return f"gradient norm is {grad_norm}"
    return None
