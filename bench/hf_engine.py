"""The transformers engine: a batch's prompts x group_size in one ``generate`` call, against one call per group.

    python -m bench.hf_engine [--model tiny|smol] [--prompts 16] [--group 8] [--max-new-tokens N] [--repeats 3]
                              [--paths per_group,batched] [--device cpu|cuda] [--sizes 128,101,77,...]

Every path is the engine's own (``HfEngine``): per_group is ``rollout.hf.max_sequences_per_call`` set to the group
size (one call per prompt, each a group of copies of one prompt: how the engine generated before it batched); batched
is one call for all (the default cap holds 16 x 8); static is batched over ``rollout.hf.cache: static`` (compiled with
CUDA graphs on a GPU) with its default batch buckets, static_exact the same without them
(``rollout.hf.static_batch_buckets: [1]``, every batch size a shape of its own). ``--sizes`` makes each pass a
sequence of calls instead, one a size, each one turn of the first N of the prompts x group sequences, as multi-turn
turns and in-flight chunks vary the live sequences call after call. The paths alternate on the same prompts in one
process, ``--repeats`` times each, after one warm-up pass of each (where a GPU compiles each new shape), so all see
the same machine. The static paths also report the (batch, cache length) shapes their calls ran at and the caches they
allocated. Reported: completions per wall second and per CPU second of each (median; with one torch thread the CPU
seconds are the work done, whatever else shares the cores), the ratios of each path to the first, and the logprobs
check. At a near-zero temperature every path draws the argmax, so their tokens must match the first path's and their
logprobs agree within float noise (the largest difference is printed); and the logprobs each path reports at the run's
temperature are compared with the trainer's teacher-forced scoring of the same tokens (float32, on the CPU).
``--device cuda`` generates in bfloat16.

``--model tiny`` is ``models/tiny-arith`` (``make model``), else the test suite's ``build/test-model/model``, on its
arithmetic prompts; ``--model smol`` is SmolLM2-135M-Instruct (``make model-smol``) on its chat word problems
(rendered with its chat template), 40 new tokens at temperature 0.7 as ``examples/smol-arith.yaml`` samples. One torch
thread (``--threads``), as a rollout runs by default. Appends one JSON line to ``build/bench/hf_engine.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, StaticCache

from services.common.config import HfEngineConfig, SamplingConfig, load_config
from services.common.model.chat import render_rows
from services.common.model.datasets import load_jsonl
from services.common.model.modeling import load_model, pack, response_logits, token_logprobs
from services.common.model.static_cache import StaticCaches
from services.rollout.engines import HfEngine

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "bench"
MODELS = {
    # name: (model folders, first that exists; its eval rows; max new tokens; temperature)
    "tiny": ((ROOT / "models/tiny-arith", ROOT / "build/test-model/model"), "eval.jsonl", 6, 1.0),
    "smol": ((ROOT / "models/smollm2-135m-instruct",), ROOT / "data/word-problems/eval.jsonl", 40, 0.7),
}
DATA = {
    ROOT / "models/tiny-arith": ROOT / "data/arith",
    ROOT / "build/test-model/model": ROOT / "build/test-model/data",
}


def resolve(model: str) -> tuple[Path, Path, int, float]:
    """(model folder, eval rows, max new tokens, temperature) for ``--model``."""
    folders, rows, tokens, temperature = MODELS[model]
    folder = next((f for f in folders if (f / "config.json").is_file()), None)
    if folder is None:
        raise SystemExit(f"no {model} model at {', '.join(map(str, folders))}: `make model` or `make model-smol`")
    return folder, rows if isinstance(rows, Path) else DATA[folder] / rows, tokens, temperature


# path: (a call per group, else one for all: rollout.hf.max_sequences_per_call; the static cache's batch buckets,
# None for the dynamic cache: rollout.hf.cache and static_batch_buckets)
PATHS: dict[str, tuple[bool, list[int] | None]] = {
    "per_group": (True, None),
    "batched": (False, None),
    "static": (False, HfEngineConfig().static_batch_buckets),
    "static_exact": (False, [1]),
}


class RecordedCaches(StaticCaches):
    """The engine's static caches, recording the (batch, cache length) shapes they serve and the caches they make."""

    def __init__(self, config: Any, bucket_tokens: int, batch_buckets: list[int]) -> None:
        super().__init__(config, bucket_tokens, batch_buckets)
        self.shapes: set[tuple[int, int]] = set()
        self.allocated = 0

    def cache(self, rows: int, length: int) -> StaticCache:
        before = self.kept.get(rows)
        cache = super().cache(rows, length)
        self.shapes.add((rows, self.kept[rows][0]))
        self.allocated += before is None or before[1] is not cache
        return cache


def engine(folder: Path, rows: Path, device: str) -> HfEngine:
    model = {"path": str(folder), "device": device, **({"dtype": "bfloat16"} if device == "cuda" else {})}
    cfg = load_config(
        None,
        model=model,
        data={"train_path": str(rows)},
        train={"max_seq_len": 512},
        rollout={"backend": "hf", "hf": {"max_sequences_per_call": None}},
    )
    return HfEngine(cfg)


def scored(model: PreTrainedModel, pairs: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """The trainer's teacher-forced logprobs of each pair's response (one forward pass of each sequence whole)."""
    with torch.no_grad():
        batch = pack(pairs, pad_id=0)
        logprobs = token_logprobs(response_logits(model, batch), batch.targets)
    return [row[: len(r)].numpy() for row, (_, r) in zip(logprobs, pairs, strict=True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, help="default: 6 for tiny, 40 for smol")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--paths", default="per_group,batched", help=f"the paths compared, the first the baseline: {', '.join(PATHS)}"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--sizes",
        help="a pass is one call a size, each one turn of that many of the prompts x group sequences (comma-separated)",
    )
    args = parser.parse_args(argv)
    paths = args.paths.split(",")
    if len(paths) < 2 or not set(paths) <= set(PATHS):
        parser.error(f"--paths: two or more of {', '.join(PATHS)}")
    sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else None
    if sizes is not None and not all(1 <= n <= args.prompts * args.group for n in sizes):
        parser.error(f"--sizes: each between 1 and --prompts x --group ({args.prompts * args.group})")
    torch.set_num_threads(args.threads)
    folder, rows_path, tokens, temperature = resolve(args.model)
    sampling = SamplingConfig(
        group_size=args.group, max_new_tokens=args.max_new_tokens or tokens, temperature=temperature
    )
    hf = engine(folder, rows_path, args.device)
    bucket_tokens = HfEngineConfig().static_bucket_tokens
    caches = {
        path: RecordedCaches(hf.model.config, bucket_tokens, buckets)
        for path, (_, buckets) in PATHS.items()
        if buckets is not None
    }
    rows = render_rows(load_jsonl(rows_path)[: args.prompts], hf.tokenizer)
    prompt_ids = [hf.tokenizer.encode(row["prompt"], add_special_tokens=False) for row in rows]
    contexts = [ids for ids in prompt_ids for _ in range(args.group)]

    def run(path: str, settings: SamplingConfig) -> tuple[float, float, list]:
        """(wall s, CPU s, the samples) of one pass by ``path``: one ``generate`` of every prompt, or with
        ``--sizes`` one turn of each size's first sequences."""
        per_group = PATHS[path][0]
        hf.static = caches.get(path)
        hf.max_per_call = args.group if per_group else None
        wall, cpu = time.perf_counter(), time.process_time()
        if sizes is None:
            generated = [g for group in hf.generate(prompt_ids, settings, 512) for g in group]
        else:
            limit = [settings.max_new_tokens]
            generated = [g for n in sizes for g in hf.generate_turns(contexts[:n], limit * n, settings, [])]
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - wall, time.process_time() - cpu, generated

    warm_up = {path: run(path, sampling)[0] for path in paths}  # allocations, lazy imports, compiles: no figure
    seconds: dict[str, list[float]] = {path: [] for path in paths}
    cpu_seconds: dict[str, list[float]] = {path: [] for path in paths}
    samples: dict[str, list] = {}
    for _ in range(args.repeats):
        for path in paths:
            wall, cpu, samples[path] = run(path, sampling)
            seconds[path].append(wall)
            cpu_seconds[path].append(cpu)
    completions = args.prompts * args.group if sizes is None else sum(sizes)
    per_s = {path: completions / statistics.median(times) for path, times in seconds.items()}
    per_cpu_s = {path: completions / statistics.median(times) for path, times in cpu_seconds.items()}

    # Logprobs: each path's sampled tokens against the trainer's scoring, and the two paths' argmax draws.
    model = load_model(folder, "float32").eval()
    if sizes is not None:
        contexts = [ids for n in sizes for ids in contexts[:n]]
    vs_scoring = {}
    for path, generated in samples.items():
        expected = scored(model, [(c, g.token_ids.tolist()) for c, g in zip(contexts, generated, strict=True)])
        vs_scoring[path] = max(
            float(np.abs(g.logprobs - e).max()) for g, e in zip(generated, expected, strict=True) if len(e)
        )
    cold = sampling.model_copy(update={"temperature": 1e-4})
    argmax = {path: run(path, cold)[2] for path in paths}
    baseline = argmax[paths[0]]
    same_tokens, argmax_diff = {}, {}
    for path in paths[1:]:
        pairs = list(zip(baseline, argmax[path], strict=True))
        same_tokens[path] = all(a.token_ids.tolist() == b.token_ids.tolist() for a, b in pairs)
        argmax_diff[path] = max(
            (
                float(np.abs(a.logprobs - b.logprobs).max())
                for a, b in pairs
                if a.token_ids.tolist() == b.token_ids.tolist() and len(a.token_ids)
            ),
            default=None,
        )
    result = {
        "model": str(folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder),
        "prompts": args.prompts,
        "group": args.group,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": temperature,
        "threads": args.threads,
        "device": args.device,
        "paths": paths,
        "sizes": sizes,
        "warm_up_seconds": {path: round(t, 3) for path, t in warm_up.items()},
        "seconds": {path: [round(t, 3) for t in times] for path, times in seconds.items()},
        "cpu_seconds": {path: [round(t, 3) for t in times] for path, times in cpu_seconds.items()},
        "completions_per_s": {path: round(value, 2) for path, value in per_s.items()},
        "completions_per_cpu_s": {path: round(value, 2) for path, value in per_cpu_s.items()},
        "over_first": {path: round(per_s[path] / per_s[paths[0]], 2) for path in paths[1:]},
        "over_first_cpu": {path: round(per_cpu_s[path] / per_cpu_s[paths[0]], 2) for path in paths[1:]},
        "argmax_same_tokens": same_tokens,
        "argmax_logprob_max_diff": argmax_diff,
        "logprob_vs_scoring_max_diff": vs_scoring,
        "static_shapes": {path: sorted(caches[path].shapes) for path in paths if path in caches},
        "static_caches_allocated": {path: caches[path].allocated for path in paths if path in caches},
        "generated_tokens_mean": {path: float(np.mean([len(g.token_ids) for g in s])) for path, s in samples.items()},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    with (OUT / "hf_engine.jsonl").open("a") as out:
        out.write(json.dumps(result) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
