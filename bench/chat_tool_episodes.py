"""A chat model calling the calculator between its messages: greedy held-out episodes with observations verbatim and
as ``tool`` messages (``rollout.observation_role``), on SmolLM2-135M-Instruct (``make model-smol``).

    python -m bench.chat_tool_episodes [--rows 48] [--model models/smollm2-135m-instruct]

Each row is a chat: a system message naming the tool, one worked exchange (the user's question, the assistant's
``<calc>123*45</calc>``, the tool's ``<result>5535</result>``, the assistant's ``5535``) and a new 3-digit by
2-digit product. Episodes are played as the trainer's held-out evaluation plays them (``episode_eval.play``:
the calculator environment, ``</calc>`` ending a turn, greedy turns), once per observation format, and scored by
``final_number``. Prints one JSON line per format and the first episodes' tokens as decoded, special tokens kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import torch

from services.common.episodes.environments import Calculator, Task
from services.common.episodes.generation import Generation
from services.common.episodes.observations import ObservationFormat, episode_tokenizer, observation_format
from services.common.episodes.runner import EpisodeLimits, LocalEnvironment, run_episodes, start_episodes
from services.common.model.modeling import load_model, load_tokenizer
from services.trainer.episode_eval import RuleReward, greedy_turns, play

SYSTEM = (
    "You have a calculator tool. Always compute products with it: write <calc>EXPRESSION</calc>, for example "
    "<calc>123*45</calc>, then stop. Then answer with the final number."
)
EXAMPLE = [
    {"role": "user", "content": "What is 123*45?"},
    {"role": "assistant", "content": "<calc>123*45</calc>"},
    {"role": "tool", "content": "<result>5535</result>"},
    {"role": "assistant", "content": "5535"},
]
LIMITS = EpisodeLimits(
    max_turns=3, max_tokens_per_turn=40, max_total_tokens=160, max_observation_tokens=40, max_seq_len=320
)


def rows_of(tokenizer, count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        chat = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": f"What is {a}*{b}?"}]
        prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        rows.append({"id": str(index), "prompt": prompt, "answer": str(a * b)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=2, help="episodes to print whole, per format")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model, tokenizer = load_model(args.model, "float32").eval(), load_tokenizer(args.model)
    tokens = episode_tokenizer(tokenizer)
    rows = rows_of(tokenizer, args.rows, args.seed)
    shown: list[str] = []

    async def generate(contexts: list[list[int]], max_tokens: list[int]) -> list[Generation]:
        return greedy_turns(model, tokenizer, contexts, max_tokens, ["</calc>"])

    async def played(some: list[dict[str, str]], observations: ObservationFormat) -> list[str]:
        """The episodes of ``some`` after their prompts, decoded with the special tokens."""
        tasks = [Task(row["id"], row["prompt"], row["answer"]) for row in some]
        episodes = [
            group[0] for group in await start_episodes(tasks, lambda: LocalEnvironment(Calculator(), 10.0), 1, tokens)
        ]
        await run_episodes(episodes, generate, LIMITS, tokens, observations)
        return [tokens.decode(e.context[e.prompt_len :], skip_special_tokens=False) for e in episodes]

    for role in ("", "tool"):
        started = time.perf_counter()
        observations = observation_format(tokenizer, role)
        result = asyncio.run(
            play(
                rows,
                lambda: LocalEnvironment(Calculator(), 10.0),
                generate,
                LIMITS,
                tokens,
                observations,
                RuleReward({"final_number": 1.0}),
            )
        )
        summary = {"observation_role": role or "(verbatim)", "rows": len(rows), "accuracy": result.accuracy}
        print(json.dumps(summary | result.metrics() | {"wall_s": round(time.perf_counter() - started, 1)}))
        shown += [f"{role or 'verbatim'}: {text!r}" for text in asyncio.run(played(rows[: args.show], observations))]
    for text in shown:
        print(text)


if __name__ == "__main__":
    main()
