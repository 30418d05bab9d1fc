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
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

import services.common.model.reward_rules  # noqa: F401  registers the built-in rules reward_function looks up
from services.common.config import RunConfig
from services.common.episodes.environments import Task
from services.common.episodes.generation import Generation
from services.common.episodes.observations import ObservationFormat, Tokenizer, observation_format
from services.common.episodes.runner import (
    EpisodeEnvironment,
    EpisodeLimits,
    TurnGenerator,
    environment_maker,
    run_episodes,
    start_episodes,
)
from services.common.model.modeling import Precision
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
        reward(c.text, task.answer, c.finish_reason, c.episode.env_reward)
        for c, task in zip(completions, tasks, strict=True)
    ]
    return EpisodeEvaluation(
        accuracy=sum(reward.right(r) for r in rewards) / len(rows),
        reward_mean=float(np.mean(rewards)),
        turns_mean=float(np.mean([e.turns for e in episodes])),
        tool_calls_mean=float(np.mean([e.tool_calls for e in episodes])),
        tool_errors_mean=float(np.mean([e.tool_errors for e in episodes])),
    )


def turn_end(tokens: list[int], limit: int, eos_id: int | None, stop: list[str], decode: Callable) -> tuple[int, bool]:
    """How many of a greedy row's ``tokens`` make the turn, and whether it stopped (else it ran out of room): up to
    ``limit``, through the end-of-sequence token or the token that completes one of ``stop`` (as vLLM's
    ``include_stop_str_in_output`` keeps it), whichever comes first."""
    for end in range(1, min(limit, len(tokens)) + 1):
        if tokens[end - 1] == eos_id:
            return end, True
        if stop and any(s in decode(tokens[:end]) for s in stop):
            return end, True
    return min(limit, len(tokens)), False


class StopStrings(StoppingCriteria):
    """Ends each row once its new text holds one of ``stop``. Not transformers' ``stop_strings``, which needs every
    character of them in the vocabulary: a tool tag the model has never seen must still end nothing, not fail."""

    def __init__(self, stop: list[str], prompt_width: int, decode: Callable):
        self.stop, self.prompt_width, self.decode = stop, prompt_width, decode

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        texts = [self.decode(row) for row in input_ids[:, self.prompt_width :].tolist()]  # (B, new so far)
        return torch.tensor([any(s in text for s in self.stop) for text in texts], device=input_ids.device)


def greedy_turns(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    contexts: list[list[int]],
    max_tokens: list[int],
    stop: list[str],
    precision: Precision | None = None,
    temperature: float = 0.0,
) -> list[Generation]:
    """One greedy turn continuing each context (left-padded into one batch), cut as ``turn_end`` says. A row's own
    limit cuts the batch's longest run: decoding a prefix does not depend on how long it goes on. ``temperature``
    above 0 samples instead (bench/tool_sampled_eval.py: held-out episodes as the rollouts sample them)."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    width = max(len(ids) for ids in contexts)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in contexts])  # (B, width)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in contexts])
    stopping = {"stopping_criteria": StoppingCriteriaList([StopStrings(stop, width, tokenizer.decode)])} if stop else {}
    was_training = model.training
    model.eval()
    try:
        # no_grad, not inference_mode: the model trains on afterwards (see evaluation.greedy_generate).
        with torch.no_grad(), precision.autocast() if precision else contextlib.nullcontext():
            output = model.generate(
                **stopping,
                input_ids=input_ids.to(model.device),
                attention_mask=attention_mask.to(model.device),
                **(
                    {"do_sample": True, "temperature": temperature, "top_k": 0}
                    if temperature > 0
                    else {"do_sample": False}
                ),
                max_new_tokens=max(max_tokens),
                pad_token_id=pad_id,
                eos_token_id=eos_id,
            )
    finally:
        model.train(was_training)
    turns = []
    for tokens, limit in zip(output[:, width:].tolist(), max_tokens, strict=True):  # (B, new)
        end, stopped = turn_end(tokens, limit, eos_id, stop, tokenizer.decode)
        turns.append(
            Generation(
                text=tokenizer.decode(tokens[:end], skip_special_tokens=True),
                token_ids=np.asarray(tokens[:end], dtype=np.int32),
                logprobs=np.zeros(end, dtype=np.float32),  # nothing trains on an evaluation's turns
                finish_reason="stop" if stopped else "length",
            )
        )
    return turns


def evaluate_episodes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    cfg: RunConfig,
    precision: Precision | None = None,
) -> EpisodeEvaluation:
    """Greedy held-out episodes of ``rows`` as ``cfg``'s rollout plays them, scored by its ``reward.functions``.
    Runs its own event loop: the trainer calls it from a worker thread."""
    stop = list(cfg.rollout.turn_stop)
    reward = RuleReward(dict(cfg.reward.functions), cfg.reward.environment_weight)

    async def generate(contexts: list[list[int]], max_tokens: list[int]) -> list[Generation]:
        return greedy_turns(model, tokenizer, contexts, max_tokens, stop, precision)

    limits, observations = EpisodeLimits.of(cfg), observation_format(tokenizer, cfg.rollout.observation_role)
    return asyncio.run(play(rows, environment_maker(cfg), generate, limits, tokenizer, observations, reward))
