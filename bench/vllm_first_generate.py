"""vLLM's first ``generate`` in a rollout on the CPU, with and without its sampler's torch.compile.

    python -m bench.vllm_first_generate [--model models/tiny-arith] [--runs 2]

Each variant runs in a fresh process, alternating: the engine as the rollout builds it (``VllmEngine``, which turns
dynamo off on the CPU), then one ``generate`` of 8 prompts with logprobs and top-k/top-p; the "compiled" variant
turns dynamo back on after the engine is built, as it was before. Prints the engine build, the first generate and
the process's CPU seconds. Needs `make model` (or another model folder).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(model: Path, train_path: Path, compiled: bool) -> str:
    began = time.monotonic()
    import torch
    from vllm import SamplingParams

    from services.common.config import load_config
    from services.rollout.engines import VllmEngine

    cfg = load_config(
        None,
        model={"path": str(model)},
        data={"train_path": str(train_path)},
        rollout={"backend": "vllm"},
        runs_dir="/tmp/rlpipe-bench",
    )
    engine = VllmEngine(cfg)
    built = time.monotonic()
    if compiled:
        torch._dynamo.config.disable = False
    params = SamplingParams(max_tokens=8, logprobs=0, temperature=1.0, top_k=5, top_p=0.9)
    engine.llm.generate(["12+34="] * 8, params)
    generated = time.monotonic()
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    variant = "compiled" if compiled else "eager"
    return f"| {variant} | {built - began:.1f} | {generated - built:.1f} | {cpu:.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-arith")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "arith" / "train.jsonl")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--one", choices=("compiled", "eager"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print(one(args.model, args.data, args.one == "compiled"))
        return
    print("| variant | engine build s | first generate s | CPU s |\n| --- | --- | --- | --- |")
    for _ in range(args.runs):
        for variant in ("compiled", "eager"):
            command = [sys.executable, "-m", "bench.vllm_first_generate", "--model", str(args.model)]
            command += ["--data", str(args.data), "--one", variant]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
            print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
