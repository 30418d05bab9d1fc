"""Multi-turn rollouts with a slow environment: one batch in hand at a time against more (``rollout.episode_batches``).

    python -m bench.episode_batches [--latency-s 0.3] [--batches 8] [--episode-batches 1 2 4] [--backend vllm|hf]

The rollout's own episode path (``EpisodeRunner``: the real engine of ``examples/tool-arith.yaml``'s model, built as
the rollout builds it, and ``TurnBatcher``) plays ``--batches`` batches of that example's prompts, each prompt's
group of episodes with a calculator whose every step answers after ``--latency-s`` (a tool behind a network, a
sandbox starting up). Batches are taken from one queue by as many workers as the stage would have lanes, for each of
``--episode-batches`` in turn, on the same engine. Reported per setting: wall seconds, episodes per second, engine
calls and the engine's busy share (the time inside its calls over the wall time). Needs ``make model-tool``. Prints
one JSON line per setting, with its episodes/s over the first setting's; appends them to
``build/bench/episode_batches.jsonl``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from services.common.config import load_config
from services.common.episodes.environments import Calculator, StepResult, Turn
from services.common.episodes.runner import EpisodeRunner
from services.common.model.datasets import read_rows
from services.common.transport.messages import Prompt
from services.rollout.engines import build_engine

T = TypeVar("T")
OUT = Path("build/bench")
LATENCY_S = 0.3  # set from --latency-s before any environment is made


class SlowCalculator(Calculator):
    """The calculator, answering each step after ``LATENCY_S``."""

    def step(self, turn: Turn) -> StepResult:
        time.sleep(LATENCY_S)
        return super().step(turn)


async def play(runner: EpisodeRunner, batches: list[list[Prompt]], lanes: int, cfg) -> float:
    """Seconds to play every batch with ``lanes`` batches in hand at once."""
    queue: asyncio.Queue[list[Prompt]] = asyncio.Queue()
    for batch in batches:
        queue.put_nowait(batch)

    async def lane() -> None:
        while not queue.empty():
            await runner.groups(queue.get_nowait(), cfg.sampling, 0, 0)

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(lanes)))
    return time.perf_counter() - started


def main() -> None:
    global LATENCY_S
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/tool-arith.yaml")
    parser.add_argument("--latency-s", type=float, default=LATENCY_S, help="seconds each environment step takes")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--episode-batches", type=int, nargs="+", default=[1, 2, 4], help="batches in hand to compare")
    parser.add_argument("--prompts-per-batch", type=int, default=16)
    parser.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    args = parser.parse_args()
    LATENCY_S = args.latency_s
    cfg = load_config(args.config)
    rollout = {"environment": f"{__name__}:SlowCalculator", "backend": args.backend}
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=rollout)})
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    engine = engine_thread.submit(build_engine, cfg).result()
    busy = [0.0, 0]  # seconds inside engine calls, and their number

    async def on_engine(call: Callable[..., T], *call_args: object) -> T:
        started = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(engine_thread, call, *call_args)
        finally:
            busy[0] += time.perf_counter() - started
            busy[1] += 1

    size = args.prompts_per_batch
    rows = read_rows(cfg.data.train_path, cfg.data.columns, limit=args.batches * size)
    prompts = [
        Prompt(group_id=f"bench-{i}", prompt_id=row.get("id", str(i)), prompt=row["prompt"], answer=row["answer"])
        for i, row in enumerate(rows)
    ]
    batches = [prompts[i * size : (i + 1) * size] for i in range(args.batches)]
    episodes = args.batches * size * cfg.sampling.group_size
    results = []
    for lanes in args.episode_batches:
        runner = EpisodeRunner(cfg, engine.tokenizer, on_engine, engine.generate_turns, engine.end_tokens)
        busy[:] = [0.0, 0]
        wall = asyncio.run(play(runner, batches, lanes, cfg))
        results.append(
            {
                "episode_batches": lanes,
                "backend": args.backend,
                "latency_s": args.latency_s,
                "episodes": episodes,
                "wall_s": round(wall, 2),
                "episodes_per_s": round(episodes / wall, 1),
                "engine_calls": busy[1],
                "engine_busy_share": round(busy[0] / wall, 3),
                "outcomes": dict(runner.metrics.outcomes),
            }
        )
        results[-1]["over_first"] = round(results[-1]["episodes_per_s"] / results[0]["episodes_per_s"], 2)
        print(json.dumps(results[-1]))
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "episode_batches.jsonl", "a") as out:
        for row in results:
            out.write(json.dumps({"time": time.time(), **row}) + "\n")


if __name__ == "__main__":
    main()
