"""The policy and its optimizer, and one GRPO update from a batch of experience groups."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from services.common.config import RunConfig
from services.common.messages import ExperienceGroup
from services.common.modeling import load_model, load_tokenizer, pack, response_logits, token_logprobs
from services.trainer.algorithms import entropy_from_logits, group_advantages, kl_penalty, masked_mean, policy_loss


def _padded(rows: list[np.ndarray], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.from_numpy(np.asarray(row, dtype=np.float32))
    return out


@dataclass
class Rollouts:
    """A batch of groups flattened to one row per completion."""

    pairs: list[tuple[list[int], list[int]]]
    sampling_logprobs: list[np.ndarray]
    ref_logprobs: list[np.ndarray]
    rewards: torch.Tensor
    group_index: torch.Tensor
    stopped: torch.Tensor  # 1.0 where generation ended on EOS
    policy_versions: torch.Tensor

    @classmethod
    def of(cls, groups: list[ExperienceGroup]) -> Rollouts:
        rows = [(g_index, g, c, ref) for g_index, g in enumerate(groups) for c, ref in zip(g.completions, g.ref_logprobs)]
        return cls(
            pairs=[(g.prompt_ids.tolist(), c.token_ids.tolist()) for _, g, c, _ in rows],
            sampling_logprobs=[c.logprobs for _, _, c, _ in rows],
            ref_logprobs=[ref for *_, ref in rows],
            rewards=torch.tensor(np.concatenate([g.rewards for g in groups]), dtype=torch.float32),
            group_index=torch.tensor([i for i, *_ in rows]),
            stopped=torch.tensor([c.finish_reason == "stop" for _, _, c, _ in rows], dtype=torch.float32),
            policy_versions=torch.tensor([float(g.policy_version) for _, g, _, _ in rows]),
        )


class Learner:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.model = load_model(cfg.model.path, cfg.model.dtype)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)
        warmup = cfg.train.warmup_steps
        # Adam's first updates are full-size whatever the gradient; warm-up keeps them from jolting the policy.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))

    def step(self, groups: list[ExperienceGroup], policy_version: int) -> dict[str, float]:
        """One optimizer step of GRPO on ``groups``; returns the step's metrics."""
        started = time.perf_counter()
        train = self.cfg.train
        self.model.train()
        batch = Rollouts.of(groups)
        advantages = group_advantages(batch.rewards, batch.group_index, "grpo")
        total_tokens = sum(len(r) for _, r in batch.pairs)
        sums = {"pg_loss": 0.0, "kl_ref": 0.0, "entropy": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "loss": 0.0}

        rows = np.arange(len(batch.pairs))
        for micro in np.array_split(rows, min(train.grad_accum_steps, len(rows))):
            packed = pack([batch.pairs[i] for i in micro], self.tokenizer.pad_token_id)
            width = packed.mask.shape[1]
            logits = response_logits(self.model, packed)
            logp = token_logprobs(logits, packed.targets)
            old_logp = _padded([batch.sampling_logprobs[i] for i in micro], width)
            ref_logp = _padded([batch.ref_logprobs[i] for i in micro], width)
            mask = packed.mask
            # The rollout's logprobs are the behaviour policy: the ratio corrects for sampling from an older version.
            pg_loss, stats = policy_loss(logp, old_logp, advantages[micro], mask, train.clip_range, train.clip_range)
            kl = masked_mean(kl_penalty(logp, ref_logp, "k3"), mask)
            entropy = masked_mean(entropy_from_logits(logits.float()), mask)
            loss = pg_loss + train.kl_coef * kl - train.entropy_coef * entropy
            # Weight micro-batches by their tokens so the sum equals the token mean over the whole batch.
            share = float(mask.sum()) / max(total_tokens, 1)
            (loss * share).backward()
            for name, value in (("pg_loss", pg_loss), ("kl_ref", kl), ("entropy", entropy), ("loss", loss), *stats.items()):
                sums[name] += float(value) * share

        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.max_grad_norm)
        learning_rate = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        lengths = torch.tensor([len(r) for _, r in batch.pairs], dtype=torch.float32)
        group_std = torch.stack([batch.rewards[batch.group_index == i].std(unbiased=False) for i in range(len(groups))])
        elapsed = time.perf_counter() - started
        return {
            **sums,
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std()),
            "advantage_mean": float(advantages.mean()),
            "zero_variance_groups": float((group_std == 0).float().mean()),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
            "termination_rate": float(batch.stopped.mean()),
            "truncation_rate": float(1 - batch.stopped.mean()),
            "grad_norm": float(grad_norm),
            "learning_rate": learning_rate,
            "generated_by_version_min": float(batch.policy_versions.min()),
            "generated_by_version_max": float(batch.policy_versions.max()),
            "staleness_mean": float((policy_version - batch.policy_versions).mean()),
            "staleness_max": float((policy_version - batch.policy_versions).max()),
            "groups": float(len(groups)),
            "completions": float(len(batch.pairs)),
            "step_time_s": elapsed,
            "tokens_per_s": total_tokens / max(elapsed, 1e-9),
        }
