"""``rlpipe plan``'s estimates for each role against the measured peaks of that role's work on the CPU.

    python -m bench.plan_check [--tokens 256] [--roles trainer,reference,rollout]

For the tiny test model (build/test-model/model, ``make model``) and SmolLM2-135M (models/smollm2-135m-instruct,
``make model-smol``),
a fresh process per case loads the model in float32 (the CPU's precision) and does one role's work, and its peak
resident memory above what it held before the model loaded (Linux's ``ru_maxrss``) is set against the estimate:

- trainer, with and without gradient checkpointing: two AdamW steps on ``--tokens`` tokens (rows of 64 tokens, the
  second half the response, scored as the trainer scores it: response logits, float32 log-softmax). The second
  step is where AdamW's moments already exist, so the peak covers weights, gradients, moments, activations and
  logits together.
- reference: one no-grad scoring pass over a group of 8 such rows (``reference.batch`` of 1 group), as the reference
  scores a group.
- rollout: a vLLM engine (in process, eager) with a KV cache of ``KV_CACHE_MIB`` generating 64 sequences of up to 32
  new tokens; measured above the process after vLLM is imported, so the library's own footprint is left out as
  the estimate leaves it out. Compared with ``sizing.rollout_on_cpu`` (the CPU backend holds the weights twice).

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
MODELS = {"tiny": ROOT / "build" / "test-model" / "model", "smol": ROOT / "models" / "smollm2-135m-instruct"}
ROW_TOKENS = 64
GROUP_SIZE = 8  # the reference's case scores one group of this many rows
KV_CACHE_MIB = 64  # the rollout case's vLLM KV cache
ROLLOUT_SEQUENCES = 64
ROLLOUT_NEW_TOKENS = 32
ROLES = ("trainer", "reference", "rollout")
PAGE = resource.getpagesize()


@dataclass(frozen=True)
class Measured:
    model: str
    role: str
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


def reference_peak(folder: Path) -> int:
    """Bytes of peak RSS one reference pass over a group adds above this process before the model loaded."""
    import torch

    from services.common.model.modeling import load_model, pack, response_logits, token_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    before = current_rss()
    model = load_model(folder, "float32").eval()
    half = ROW_TOKENS // 2
    vocab = model.config.vocab_size
    pairs = [
        (torch.randint(3, vocab, (half,)).tolist(), torch.randint(3, vocab, (half,)).tolist())
        for _ in range(GROUP_SIZE)
    ]
    batch = pack(pairs, pad_id=0)
    with torch.no_grad():
        token_logprobs(response_logits(model, batch), batch.targets)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def rollout_peak(folder: Path) -> int:
    """Bytes of peak RSS a vLLM engine adds, loading and generating, above this process once vLLM is imported."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in process, as the rollout runs it
    from vllm import LLM, SamplingParams, TokensPrompt

    before = current_rss()
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=ROW_TOKENS,
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_MIB << 20,
        seed=0,
    )
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = [
        TokensPrompt(prompt_token_ids=[3 + i % (vocab - 3)] * (ROW_TOKENS // 2)) for i in range(ROLLOUT_SEQUENCES)
    ]
    llm.generate(prompts, SamplingParams(max_tokens=ROLLOUT_NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def estimate_bytes(folder: Path, role: str, tokens: int, checkpointing: bool) -> int:
    from services.cli.sizing import SizingInputs, estimate, read_model_shape, rollout_on_cpu

    inputs = SizingInputs(
        micro_batch_tokens=tokens,
        max_seq_len=ROW_TOKENS,
        group_size=GROUP_SIZE,
        reference_groups=1,
        rollout_sequences=ROLLOUT_SEQUENCES,
        kv_cache_bytes=KV_CACHE_MIB << 20,
        gradient_checkpointing=checkpointing,
        model_dtype="float32",
        master_dtype="float32",
    )
    est = estimate(read_model_shape(folder), inputs)
    return rollout_on_cpu(est) if role == "rollout" else getattr(est, role).total


def measure(role: str, folder: Path, tokens: int, checkpointing: bool) -> int:
    if role == "trainer":
        return step_peak(folder, tokens, checkpointing)
    return reference_peak(folder) if role == "reference" else rollout_peak(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens of the micro-batch (a multiple of 64)")
    parser.add_argument("--roles", default=",".join(ROLES), help=f"comma-separated, of {', '.join(ROLES)}")
    parser.add_argument("--child", nargs=4, metavar=("ROLE", "FOLDER", "TOKENS", "CKPT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        role, folder, tokens, checkpointing = args.child
        print(measure(role, Path(folder), int(tokens), checkpointing == "1"))
        return
    roles = [role for role in args.roles.split(",") if role]
    if unknown := set(roles) - set(ROLES):
        sys.exit(f"--roles: {sorted(unknown)} not among {', '.join(ROLES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    for name, folder in MODELS.items():
        if not (folder / "config.json").is_file():
            print(f"{name}: {folder} missing, skipped (see this script's docstring)")
            continue
        cases = [(role, ckpt) for role in roles for ckpt in ((False, True) if role == "trainer" else (False,))]
        for role, checkpointing in cases:
            child = [sys.executable, "-m", "bench.plan_check", "--child", role, str(folder), str(args.tokens)]
            done = subprocess.run([*child, str(int(checkpointing))], cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{name} {role}: the measuring process failed:\n{done.stderr[-2000:]}")
            measured = int(done.stdout.strip().splitlines()[-1])
            estimate = estimate_bytes(folder, role, args.tokens, checkpointing)
            results.append(Measured(name, role, checkpointing, args.tokens, estimate, measured))
    with (OUT / "plan_check.jsonl").open("w") as out:
        for result in results:
            out.write(json.dumps({**result.__dict__, "ratio": result.ratio}) + "\n")
    print(f"{'model':6} {'role':9} {'checkpointing':13} {'estimate MiB':>12} {'measured MiB':>12} {'ratio':>6}")
    for r in results:
        print(
            f"{r.model:6} {r.role:9} {r.gradient_checkpointing!s:13} {r.estimate_bytes / 2**20:12.1f} "
            f"{r.measured_bytes / 2**20:12.1f} {r.ratio:6.2f}"
        )


if __name__ == "__main__":
    main()
