"""Held-out episodes sampled as the rollouts sample them, for a model and its checkpoints (docs/agents.md).

    python -m bench.tool_sampled_eval examples/tool-arith.yaml models/tiny-tool-arith runs/tool-arith/step-200

The trainer's held-out evaluation decodes greedily; a policy whose greedy answer is already right everywhere can
still learn to sample right more often, which is what GRPO trains. This plays ``--samples`` episodes per held-out
row (``data.eval_path``'s first ``data.eval_size`` rows) with the config's environment, budgets and reward, at its
``sampling.temperature`` (top-p 1), through the same loop as the trainer's evaluation, and prints one line per model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import torch

from services.common.config import load_config
from services.common.episodes.generation import Generation
from services.common.episodes.observations import episode_tokenizer, observation_format
from services.common.episodes.runner import EpisodeLimits, environment_maker
from services.common.model.chat import render_rows
from services.common.model.datasets import load_jsonl
from services.common.model.modeling import load_model, load_tokenizer
from services.trainer.episode_eval import RuleReward, greedy_turns, play


def sampled_evaluation(config: Path, model_dir: Path, samples: int, seed: int) -> dict[str, str | int | float]:
    cfg = load_config(config)
    if cfg.sampling.top_p != 1.0:
        raise ValueError(f"sampling.top_p is {cfg.sampling.top_p}: this bench samples at top-p 1 only")
    if cfg.data.eval_path is None:
        raise ValueError(f"{config} sets no data.eval_path: there are no held-out rows to sample")
    model, tokenizer = load_model(model_dir, "float32").eval(), load_tokenizer(model_dir)
    rows = render_rows(load_jsonl(cfg.data.eval_path)[: cfg.data.eval_size], tokenizer)
    stop = list(cfg.rollout.turn_stop)
    torch.manual_seed(seed)

    async def generate(contexts: list[list[int]], max_tokens: list[int]) -> list[Generation]:
        return greedy_turns(model, tokenizer, contexts, max_tokens, stop, temperature=cfg.sampling.temperature)

    repeated = [{**row, "id": f"{row.get('id', i)}-{k}"} for i, row in enumerate(rows) for k in range(samples)]
    reward = RuleReward(dict(cfg.reward.functions), cfg.reward.environment_weight)
    limits, observations = EpisodeLimits.of(cfg), observation_format(tokenizer, cfg.rollout.observation_role)
    tokens = episode_tokenizer(tokenizer)
    result = asyncio.run(play(repeated, environment_maker(cfg), generate, limits, tokens, observations, reward))
    return {"model": str(model_dir), "episodes": len(repeated), "accuracy": result.accuracy, **result.metrics()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("config", type=Path, help="the run's config (environment, budgets, reward, eval rows)")
    parser.add_argument("models", nargs="+", type=Path, help="model folders: the base model, checkpoints' step-N")
    parser.add_argument("--samples", type=int, default=4, help="episodes per held-out row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for model_dir in args.models:
        print(json.dumps(sampled_evaluation(args.config, model_dir, args.samples, args.seed)), flush=True)


if __name__ == "__main__":
    main()
