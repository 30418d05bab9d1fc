"""Wire messages with sensible defaults, one line each: a prompt "1+1=" answered "2", completions of a few tokens,
and the group as each stage hands it on. Any field can be given by keyword; the defaults are valid messages that no
test depends on except as "some well-formed group"."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.common.transport.messages import (
    Completion,
    ExperienceGroup,
    Prompt,
    RolloutGroup,
    ScoredGroup,
    advance,
)


def prompt(group_id: str = "g", **fields) -> Prompt:
    """The prompt "1+1=" with the answer "2"; its prompt id is the group id unless given."""
    return Prompt(**{"group_id": group_id, "prompt_id": group_id, "prompt": "1+1=", "answer": "2", **fields})


def completion(tokens: int | Sequence[int] | np.ndarray = 3, logprob: float = -0.5, **fields) -> Completion:
    """A completion "x" that stopped: ``tokens`` ids (a count gives 0, 1, ...; an array is kept as it is, dtype
    and all), each sampled with ``logprob``."""
    if isinstance(tokens, int):
        token_ids = np.arange(tokens, dtype=np.int32)
    elif isinstance(tokens, np.ndarray):
        token_ids = tokens
    else:
        token_ids = np.asarray(tokens, np.int32)
    defaults = {
        "text": "x",
        "token_ids": token_ids,
        "logprobs": np.full(token_ids.shape, logprob, np.float32),
        "finish_reason": "stop",
    }
    return Completion(**{**defaults, **fields})


def rollout_group(
    group_id: str = "g",
    completions: list[Completion] | None = None,
    prompt_ids: Sequence[int] | np.ndarray = (1, 2),
    policy_version: int = 0,
    **prompt_fields,
) -> RolloutGroup:
    """``prompt(group_id, **prompt_fields)`` generated: ``completions`` (one ``completion()`` unless given)."""
    return advance(
        prompt(group_id, **prompt_fields),
        RolloutGroup,
        prompt_ids=np.asarray(prompt_ids, np.int32) if not isinstance(prompt_ids, np.ndarray) else prompt_ids,
        policy_version=policy_version,
        completions=[completion()] if completions is None else completions,
    )


def scored(group: RolloutGroup, rewards: Sequence[float] | np.ndarray | None = None) -> ScoredGroup:
    """``group`` as the reward stage hands it on: ``rewards`` (0 for every completion unless given)."""
    values = np.zeros(len(group.completions), np.float32) if rewards is None else np.asarray(rewards, np.float32)
    return advance(group, ScoredGroup, rewards=values)


def referenced(group: ScoredGroup, ref_logprobs: list[np.ndarray] | None = None) -> ExperienceGroup:
    """``group`` as the reference stage hands it on: ``ref_logprobs`` (0 for every token unless given)."""
    if ref_logprobs is None:
        ref_logprobs = [np.zeros(c.token_ids.shape, np.float32) for c in group.completions]
    return advance(group, ExperienceGroup, ref_logprobs=ref_logprobs)


def scored_group(group_id: str = "g", rewards: Sequence[float] | None = None, **rollout) -> ScoredGroup:
    """``rollout_group(group_id, **rollout)``, scored with ``rewards``."""
    return scored(rollout_group(group_id, **rollout), rewards)


def experience_group(
    group_id: str = "g",
    rewards: Sequence[float] | None = None,
    ref_logprobs: list[np.ndarray] | None = None,
    **rollout,
) -> ExperienceGroup:
    """``rollout_group(group_id, **rollout)`` through every stage: scored with ``rewards``, then referenced."""
    return referenced(scored(rollout_group(group_id, **rollout), rewards), ref_logprobs)


def answered(group_id: str, answer: str, texts: list[str], finish: str = "stop") -> RolloutGroup:
    """A group for a reward to judge: the prompt "1+1=" with ``answer``, one one-token completion per text."""
    completions = [completion([3], text=text, finish_reason=finish) for text in texts]
    return rollout_group(group_id, completions, answer=answer)
