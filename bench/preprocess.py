"""What ``data.tokenize_workers`` buys: chat rows rendered and tokenized per second at 1 worker (inline, the
default) and at N (a pool of processes), in the same run.

The rows are a chat dataset (``--data``: data/word-problems/train.jsonl by default, 4,000 rows from
``rlpipe build-tiny --task word-problems``), the tokenizer SmolLM2-135M-Instruct's (``--model``,
models/smollm2-135m-instruct from ``make model-smol``). Each worker count is timed on:

- ``prepare``: every row rendered with the chat template and tokenized, as a held-out set is at start
  (``Preprocessor.render`` then ``encode``, whole lists);
- ``feed``: the trainer's feeder walking the dataset one row at a time, each prompt rendered (``PromptFeeder``
  over ``open_prompts``; with workers, rows rendered ahead of the walk).

The pool's start (a fork server importing transformers, each worker loading the tokenizer) is timed apart: a role
pays it once. ``--repeats`` runs of each, the median kept.

    python -m bench.preprocess [--workers 1 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

from services.common.config import DataConfig
from services.common.model.chat import prompt_text
from services.common.model.datasets import open_prompts, read_rows
from services.common.model.modeling import load_tokenizer
from services.common.model.preprocess import Preprocessor
from services.trainer.intake.feeder import PromptFeeder

ROOT = Path(__file__).resolve().parents[1]


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-instruct")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "word-problems" / "train.jsonl")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    data = DataConfig(train_path=args.data, shuffle=False)
    rows = read_rows(args.data, data.columns)
    print(f"{len(rows)} rows of {args.data}, tokenizer of {args.model}", flush=True)
    baseline: dict[str, float] = {}
    for workers in args.workers:
        started = time.perf_counter()
        prep = Preprocessor(tokenizer, args.model, workers)
        if prep.pool is not None:  # every worker up, its tokenizer loaded
            list(prep.pool.map(int, range(workers)))
            prep.render(rows[: 2 * workers])
        start_s = time.perf_counter() - started

        def prepare(prep: Preprocessor = prep) -> None:
            prep.encode(prep.render(rows))

        def feed(prep: Preprocessor = prep) -> None:
            ahead = prep.rendered_ahead if prep.pool is not None else None
            render = partial(prompt_text, tokenizer=tokenizer)
            feeder = PromptFeeder(open_prompts(data, render=render, render_ahead=ahead), seed=0, shuffle=False)
            for _ in range(len(rows)):
                feeder.next()

        rates = {}
        for name, work in (("prepare", prepare), ("feed", feed)):
            rates[name] = len(rows) / statistics.median(timed(work) for _ in range(args.repeats))
            baseline.setdefault(name, rates[name])
        prep.close()
        print(
            f"workers {workers}: prepare {rates['prepare']:7.0f} rows/s ({rates['prepare'] / baseline['prepare']:.2f}x)"
            f"  feed {rates['feed']:7.0f} rows/s ({rates['feed'] / baseline['feed']:.2f}x)  pool start {start_s:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
