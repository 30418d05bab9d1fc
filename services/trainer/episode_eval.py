"""Held-out evaluation of a multi-turn run: greedy episodes through the run's environment, scored by its reward.

A run whose rollout plays episodes (``rollout.environment`` or ``rollout.environment_url``) is measured the way it
is trained: each held-out row is one episode with the same environment and tools, ``rollout.turn_stop`` and the
turn and token budgets, the model's turns decoded greedily, the finished episode scored by ``reward.functions`` as
the reward role scores a completion (observations included in the text). An episode is right when it earns the
reward is positive (``RuleReward``): with ``final_number: 1.0``, when its last number is the answer. A single-turn
run keeps ``services.common.model.evaluation``'s greedy exact match, unchanged.

The episode loop is the rollout's own (``services.common.episodes.runner``); only the engine differs: the trainer's
model, greedy, on its device and under its autocast.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

import services.common.model.reward_rules  # noqa: F401  registers the built-in rules reward_function looks up
from services.common.config import RunConfig
from services.common.episodes.environments import Task
from services.common.episodes.generation import Generation
from services.common.episodes.observations import ObservationFormat, Tokenizer, episode_tokenizer, observation_format
from services.common.episodes.runner import (
    EpisodeEnvironment,
    EpisodeLimits,
    TurnGenerator,
    environment_maker,
    run_episodes,
    start_episodes,
)
from services.common.model.batch_generation import generate_batch
from services.common.model.modeling import Precision, decode_text
from services.common.model.padding import eos_token_id, pad_token_id
from services.common.registry import reward_function


@dataclass(frozen=True)
class EpisodeEvaluation:
    """What the held-out episodes came to: the accuracy, and per-episode means beside it."""

    accuracy: float
    reward_mean: float
    turns_mean: float
    tool_calls_mean: float
    tool_errors_mean: float

    def metrics(self) -> dict[str, float]:
        """The metrics row's fields beside ``eval_accuracy``."""
        return {
            "eval/reward_mean": self.reward_mean,
            "eval/turns_mean": self.turns_mean,
            "eval/tool_calls_mean": self.tool_calls_mean,
            "eval/tool_errors_mean": self.tool_errors_mean,
        }


class RuleReward:
    """``reward.functions``' weighted sum plus ``reward.environment_weight`` times the episode's own reward, and
    what counts as right: a positive reward. With a correctness rule (1 or 0) and penalties (0 or below) beside it,
    the usual mix, that is the answer right and no penalty that outweighs it."""

    def __init__(self, weights: dict[str, float], environment_weight: float = 0.0):
        if not any(weight > 0 for weight in weights.values()) and environment_weight <= 0:
            raise ValueError(
                "the held-out evaluation of episodes scores them with reward.functions and "
                "reward.environment_weight, none of which has a positive weight here; name one (such as "
                "final_number: 1.0) or leave data.eval_path empty"
            )
        self.rules = [(reward_function(name), weight) for name, weight in weights.items()]
        self.environment_weight = environment_weight

    def __call__(self, text: str, answer: str, finish_reason: str, env_reward: float = 0.0) -> float:
        rules = sum(weight * rule(text, answer, finish_reason) for rule, weight in self.rules)
        return rules + self.environment_weight * env_reward

    @staticmethod
    def right(reward: float) -> bool:
        return reward > 0


async def play(
    rows: list[dict[str, Any]],
    make_environment: Callable[[], EpisodeEnvironment],
    generate: TurnGenerator,
    limits: EpisodeLimits,
    tokenizer: Tokenizer,
    observations: ObservationFormat,
    reward: RuleReward,
) -> EpisodeEvaluation:
    """One episode per row (its ``prompt`` rendered, its ``answer``), all run to their end, then scored."""
    if not rows:
        raise ValueError("the held-out evaluation needs at least one row")
    tasks = [
        Task(prompt_id=str(row.get("id", index)), prompt=row["prompt"], answer=row["answer"], info=row.get("info", {}))
        for index, row in enumerate(rows)
    ]
    groups = await start_episodes(tasks, make_environment, 1, tokenizer)
    episodes = [group[0] for group in groups]
    await run_episodes(episodes, generate, limits, tokenizer, observations)
    completions = [episode.completion(tokenizer) for episode in episodes]
    rewards = [
        reward(c.text, task.answer, c.finish_reason, episode.env_reward)
        for c, episode, task in zip(completions, episodes, tasks, strict=True)
    ]
    return EpisodeEvaluation(
        accuracy=sum(reward.right(r) for r in rewards) / len(rows),
        reward_mean=float(np.mean(rewards)),
        turns_mean=float(np.mean([e.turns for e in episodes])),
        tool_calls_mean=float(np.mean([e.tool_calls for e in episodes])),
        tool_errors_mean=float(np.mean([e.tool_errors for e in episodes])),
    )


def greedy_turns(
    model: torch.nn.Module,  # a transformers model, or peft's wrapper of one
    tokenizer: PreTrainedTokenizerBase,
    contexts: list[list[int]],
    max_tokens: list[int],
    stop: list[str],
    precision: Precision | None = None,
    temperature: float = 0.0,
    batch_size: int | None = None,
) -> list[Generation]:
    """One greedy turn continuing each context, ``batch_size`` contexts per ``generate`` call (None: all in one),
    each ending as a rollout's turn does: through its end-of-sequence token or the token that completes one of
    ``stop``, else at its own limit (``batch_generation.generate_batch``). ``temperature`` above 0 samples instead
    (bench/tool_sampled_eval.py: held-out episodes as the rollouts sample them)."""
    eos_id = eos_token_id(tokenizer)
    continuations = generate_batch(
        model,
        contexts,
        max_tokens,
        pad_id=pad_token_id(tokenizer),
        end_tokens=() if eos_id is None else (eos_id,),
        stop=stop,
        decode=partial(decode_text, tokenizer),
        temperature=temperature,
        max_per_call=batch_size,
        precision=precision,
    )
    return [
        Generation(
            text=decode_text(tokenizer, c.token_ids, skip_special_tokens=True),
            token_ids=np.asarray(c.token_ids, dtype=np.int32),
            logprobs=c.logprobs,
            finish_reason="stop" if c.stopped else "length",
        )
        for c in continuations
    ]


def evaluate_episodes(
    model: torch.nn.Module,  # a transformers model, or peft's wrapper of one
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    cfg: RunConfig,
    precision: Precision | None = None,
) -> EpisodeEvaluation:
    """Greedy held-out episodes of ``rows`` as ``cfg``'s rollout plays them, scored by its ``reward.functions``.
    Runs its own event loop: the trainer calls it from a worker thread."""
    stop, batch_size = list(cfg.rollout.turn_stop), cfg.data.eval_batch_size
    reward = RuleReward(dict(cfg.reward.functions), cfg.reward.environment_weight)

    async def generate(contexts: list[list[int]], max_tokens: list[int]) -> list[Generation]:
        return greedy_turns(model, tokenizer, contexts, max_tokens, stop, precision, batch_size=batch_size)

    limits, observations = EpisodeLimits.of(cfg), observation_format(tokenizer, cfg.rollout.observation_role)
    tokens = episode_tokenizer(tokenizer)
    return asyncio.run(play(rows, environment_maker(cfg), generate, limits, tokens, observations, reward))
