"""Peak memory of scoring responses over a large vocabulary: the plain formulas against ``logit_math``'s chunks.

    python -m bench.logit_memory [--rows 32] [--width 40] [--vocab 49152] [--repeats 3]

The defaults are examples/smol-lora.yaml's step: 4 prompts x 8 samples, 40 new tokens, SmolLM2's vocabulary,
float32 logits. Two cases, each variant in a fresh process (so one's freed heap cannot hide the other's peak):

- ``trainer``: the learner's loss terms on logits that need a gradient: per-token logprobs, the entropy
  (a statistic at ``entropy_coef: 0``, as in the example) and a backward pass to the logits;
- ``reference``: per-token logprobs without a graph, as the reference scores.

``plain`` is the code before: ``log_softmax(logits.float()).gather(...)`` and ``logsumexp(z) - sum(softmax(z) * z)``
in the graph; ``chunked`` is ``logit_math`` as the learner and reference call it now. The figure is the growth of
the process's peak resident memory (VmHWM, reset after the logits exist) over the logits themselves, as a
multiple of one float32 copy of the logits; the medians and the plain/chunked ratio are printed and written to
``build/bench/logit_memory.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from bench.mmap_threshold import peak_rss_reset, rss_kib

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "bench"
VARIANTS = ("plain", "chunked")
CASES = ("trainer", "reference")


def plain_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def plain_entropy(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def worker(variant: str, case: str, rows: int, width: int, vocab: int) -> dict:
    """One variant and case in this process: the peak growth over the logits, in MiB."""
    from services.common.model.logit_math import entropy, token_logprobs

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn((rows, width, vocab), generator=generator).requires_grad_(case == "trainer")
    targets = torch.randint(0, vocab, (rows, width), generator=generator)
    peak_rss_reset()
    before = rss_kib("VmRSS")
    if case == "reference":
        with torch.no_grad():
            logp = (plain_logprobs if variant == "plain" else token_logprobs)(logits, targets)
    elif variant == "plain":
        logp = plain_logprobs(logits, targets)
        loss = logp.mean() - 0.0 * plain_entropy(logits.float()).mean()
        loss.backward()
    else:
        logp = token_logprobs(logits, targets)
        with torch.no_grad():
            entropy(logits).mean()
        logp.mean().backward()
    peak_mib = (rss_kib("VmHWM") - before) / 1024
    return {"variant": variant, "case": case, "peak_mib": peak_mib, "logits_mib": logits.numel() * 4 / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--width", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        variant, case = args.worker
        print(json.dumps(worker(variant, case, args.rows, args.width, args.vocab)))
        return

    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    for _ in range(args.repeats):
        for case in CASES:
            for variant in VARIANTS:
                shape = ["--rows", str(args.rows), "--width", str(args.width), "--vocab", str(args.vocab)]
                command = [sys.executable, "-m", "bench.logit_memory", "--worker", variant, case, *shape]
                done = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    with (OUT / "logit_memory.jsonl").open("w") as f:
        for row in results:
            f.write(json.dumps(row) + "\n")
    logits_mib = results[0]["logits_mib"]
    print(f"logits [{args.rows}, {args.width}, {args.vocab}] float32: {logits_mib:.0f} MiB")
    for case in CASES:
        median = {
            v: statistics.median(r["peak_mib"] for r in results if r["case"] == case and r["variant"] == v)
            for v in VARIANTS
        }
        print(
            f"{case:9}  peak over the logits: plain {median['plain']:7.0f} MiB ({median['plain'] / logits_mib:.2f}x)"
            f"  chunked {median['chunked']:7.0f} MiB ({median['chunked'] / logits_mib:.2f}x)"
            f"  plain/chunked {median['plain'] / max(median['chunked'], 1.0):.1f}x"
        )


if __name__ == "__main__":
    main()
