"""One episode as it is played: its limits, its tokens with their logprobs and loss mask, its named outcome, and
the completion it becomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from services.common.config import RunConfig
from services.common.episodes.episode_environment import EpisodeEnvironment
from services.common.episodes.observations import Tokenizer
from services.common.transport.messages import Completion, Episode

Outcome = Literal["done", "max_turns", "max_tokens", "env_error", "timeout", "truncated"]

# Outcomes that cut the episode short of an answer: its completion reads as one that ran out of length.
CUT_SHORT: tuple[Outcome, ...] = ("max_turns", "max_tokens", "truncated")


@dataclass(frozen=True)
class EpisodeLimits:
    """The budgets of one episode, from the rollout section and train.max_seq_len."""

    max_turns: int
    max_tokens_per_turn: int
    max_total_tokens: int
    max_observation_tokens: int
    max_seq_len: int

    @classmethod
    def of(cls, cfg: RunConfig) -> EpisodeLimits:
        r = cfg.rollout
        seq_len = cfg.train.max_seq_len
        return cls(r.max_turns, r.max_tokens_per_turn, r.max_total_tokens, r.max_observation_tokens, seq_len)


@dataclass
class EpisodeState:
    """One episode as it runs: the whole context (prompt first) and, after the prompt, logprobs and loss mask."""

    environment: EpisodeEnvironment
    context: list[int]
    prompt_len: int
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    # The policy version of each token after the prompt, where the generations say theirs (Generation.policy_version:
    # the rollout's); an observation carries the version of the turn it answers. Empty in the trainer's evaluation.
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_seconds: float = 0.0
    env_reward: float = 0.0  # the environment's own reward parts, summed: trained on with reward.environment_weight
    outcome: Outcome | None = None
    # (group id, index in the group): what seeds each turn's draws when run_episodes is given a run seed
    # (train.deterministic); unused otherwise.
    sample: tuple[str, int] = ("", 0)

    @property
    def generated(self) -> int:
        return len(self.context) - self.prompt_len

    def room(self, limits: EpisodeLimits) -> int:
        """Tokens the next turn may sample."""
        return min(
            limits.max_tokens_per_turn,
            limits.max_total_tokens - self.generated,
            limits.max_seq_len - len(self.context),
        )

    @property
    def newest_version(self) -> int | None:
        return max(self.versions) if self.versions else None

    def completion(self, tokenizer: Tokenizer, group_version: int | None = None) -> Completion:
        """The ended episode; per-token versions only where a token's differs from ``group_version``."""
        assert self.outcome is not None, "an episode becomes a completion once it has ended"
        ids = self.context[self.prompt_len :]
        versions = np.asarray(self.versions, dtype=np.int32)
        differ = group_version is not None and len(versions) == len(ids) and bool((versions != group_version).any())
        return Completion(
            text=tokenizer.decode(ids, skip_special_tokens=True),
            token_ids=np.asarray(ids, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            finish_reason="length" if self.outcome in CUT_SHORT else "stop",
            loss_mask=np.asarray(self.mask, dtype=np.int32),
            token_versions=versions if differ else None,
            episode=Episode(
                turns=self.turns,
                tool_calls=self.tool_calls,
                tool_errors=self.tool_errors,
                env_seconds=round(self.env_seconds, 6),
                env_reward=self.env_reward,
                outcome=self.outcome,
            ),
        )
