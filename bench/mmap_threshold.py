"""Whether the vLLM rollout should fix glibc's mmap threshold: generation speed against memory kept after syncs.

    python -m bench.mmap_threshold [--model tiny|smol] [--repeats 3]

vLLM's CPU kernels repack each linear layer into new blocks on every weight load and free the old ones. glibc
raises its mmap threshold to the size of each large block freed, so from the second load on those blocks come
from the heap, which keeps what is freed for reuse: a rollout settles at the model plus that kept heap.
Fixing the threshold at 128 KiB (``mallopt``, before the model loads) returns every such block to the kernel,
and makes each step's large buffers fresh pages. Two variants, each in a fresh process, taking turns
``--repeats`` times so load from the rest of the machine hits them alike:

- ``glibc``: the engine as it ships, glibc's default;
- ``128k``: the threshold fixed at 128 KiB before the engine is built.

Each process generates the example's first rollout batch (one untimed warm-up, then ``--batches`` timed), then
reloads the model's own weights three times, as syncs of new versions would, and reports for the last two the
growth of its peak resident memory after the heap was trimmed (``malloc_trim``): the kept heap a reload faults
back in. Writes ``build/bench/mmap_threshold.jsonl`` and prints the medians and the ratios against ``glibc``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "bench"
VARIANTS = ("glibc", "128k")
M_MMAP_THRESHOLD = -3  # malloc.h


def peak_rss_reset(trim: bool = True) -> None:
    """Reset the kernel's high-water mark of this process's resident memory (Linux, since 4.0); with ``trim``,
    after handing freed heap memory back to the kernel first, so pages malloc kept from earlier work cannot absorb
    the next allocations unseen. tests/rollout/test_sync_memory.py measures syncs with it too."""
    gc.collect()
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def rss_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in KiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def worker(model: str, variant: str, batches: int) -> dict:
    """One variant in this process: generated tokens/s and the memory each of two syncs added."""
    from bench.throughput import MODELS, config_for, prompt_batch
    from services.common.model.modeling import load_model
    from services.rollout import engines

    if variant == "128k":
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10)
    cfg = config_for(MODELS[model])
    engine = engines.VllmEngine(cfg)
    _, prompt_ids = prompt_batch(cfg, engine.tokenizer)
    engine.generate(prompt_ids, cfg.sampling, cfg.train.max_seq_len)  # warm-up
    started, tokens = time.perf_counter(), 0
    for _ in range(batches):
        groups = engine.generate(prompt_ids, cfg.sampling, cfg.train.max_seq_len)
        tokens += sum(len(g.token_ids) for group in groups for g in group)
    tokens_per_s = tokens / (time.perf_counter() - started)

    weights = load_model(cfg.model.folder, "float32").state_dict()
    growth = []
    for sync in range(3):
        version = {name: tensor + 1e-3 * (sync + 1) for name, tensor in weights.items()}
        peak_rss_reset()
        before = rss_kib("VmRSS")
        engine.load_weights(iter(version.items()))
        growth.append((rss_kib("VmHWM") - before) / 1024)
        del version
    return {"variant": variant, "tokens_per_s": tokens_per_s, "sync_growth_mib": growth[1:]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "smol"), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.batches)))
        return

    rows = []
    for repeat in range(args.repeats):
        for variant in VARIANTS:
            done = subprocess.run(
                [sys.executable, "-m", "bench.mmap_threshold", "--model", args.model, "--worker", variant,
                 "--batches", str(args.batches)],
                cwd=ROOT, capture_output=True, text=True, check=True,
            )  # fmt: skip
            row = {"model": args.model, "repeat": repeat, **json.loads(done.stdout.strip().splitlines()[-1])}
            print(json.dumps(row), flush=True)
            rows.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "mmap_threshold.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    def median(variant: str, key: str) -> float:
        values = [v for r in rows if r["variant"] == variant for v in ([r[key]] if key == "tokens_per_s" else r[key])]
        return statistics.median(values)

    speed = {v: median(v, "tokens_per_s") for v in VARIANTS}
    growth = {v: median(v, "sync_growth_mib") for v in VARIANTS}
    for variant in VARIANTS:
        print(
            f"{variant:12s} {speed[variant]:8.1f} generated tokens/s ({speed[variant] / speed['glibc']:.3f}x glibc)"
            f"   {growth[variant]:6.1f} MiB more per sync"
        )


if __name__ == "__main__":
    main()
