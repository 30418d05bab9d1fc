"""The learner beyond SmolLM2's 135M: ``Learner.step`` on a random-initialised model of Qwen2.5-0.5B's shape.

    python -m bench.learner_shape [--steps 3] [--groups 2] [--group-size 4] [--prompt 32] [--response 64]
                                  [--device cpu|cuda] [--dtype float32|bfloat16] [--master-weights float32|model_dtype]
                                  [--gradient-checkpointing]

Builds ``build/bench/qwen2.5-0.5b-random`` once: Qwen2.5-0.5B's architecture from its config (``QWEN25_05B``
below, written here, nothing downloaded) with random weights and rlpipe's tiny character tokenizer (the learner
needs a tokenizer only for its pad id; random token ids of the full vocabulary stand in for text). Then times
``Learner.step`` (the trainer's whole step: pi_old where configured, the GRPO loss, backward, clipping, AdamW) on
``--groups`` groups of ``--group-size`` completions, each ``--prompt`` + ``--response`` tokens, after one warm-up
step, and prints the median seconds per step, trained tokens/s (prompt and response, as the FLOPs count them),
the process's CPU seconds per step (which other work on a busy machine does not inflate, unlike the wall time)
and, on a GPU the peak table knows, the learner's ``perf/mfu``. Writes ``build/bench/learner_shape.jsonl``.

float32 AdamW state for 494M parameters is about 8 GiB (weights, gradients, two moments), so the defaults keep the
batch small; ``--master-weights model_dtype`` with ``--dtype bfloat16`` keeps them in bfloat16 (half of that). On a
GPU, ``--device cuda --dtype bfloat16`` is the trainer's usual setting: bfloat16 compute over float32 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.pipeline_run import cpu_model
from services.common.observe import metrics as m
from services.common.observe.records import MetricsRow

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "bench"
MODEL_DIR = OUT / "qwen2.5-0.5b-random"

# Qwen/Qwen2.5-0.5B's config.json, as published (architecture fields only): 494M parameters, tied embeddings.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}


def build_model(folder: Path) -> Path:
    """The random-initialised model folder, built once (its config.json is checked against ``QWEN25_05B``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.cli.build.tiny_model import build_char_tokenizer

    stamp = folder / "bench-shape.json"  # what it was built from: transformers rewrites some config.json fields
    if stamp.is_file() and json.loads(stamp.read_text()) == QWEN25_05B:
        return folder
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in QWEN25_05B.items() if k != "architectures"}))
    # Half the disk; the learner loads it in its own dtype. (transformers' functools.wraps(Module.to) loses the
    # bound self's type.)
    model.to(torch.bfloat16).save_pretrained(folder)  # pyright: ignore[reportArgumentType]
    build_char_tokenizer().save_pretrained(folder)
    stamp.write_text(json.dumps(QWEN25_05B))
    return folder


def run_config(folder: Path, args: argparse.Namespace):
    from services.common.config import load_config

    data = OUT / "learner_shape-prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return load_config(
        None,
        run_id="bench-learner-shape",
        runs_dir=str(OUT / "runs"),
        model={"path": str(folder), "device": args.device, "dtype": args.dtype},
        data={"train_path": str(data)},
        sampling={"group_size": args.group_size, "max_new_tokens": args.response},
        train={
            "batch_size": args.groups,
            "max_seq_len": args.prompt + args.response,
            "master_weights": args.master_weights,
            "gradient_checkpointing": args.gradient_checkpointing,
        },
    )


def groups_of(cfg, args: argparse.Namespace, vocab: int) -> list:
    """``--groups`` experience groups of random tokens, with rewards that vary (so GRPO has advantages)."""
    from services.common.transport.messages import (
        Completion,
        ExperienceGroup,
        Prompt,
        RolloutGroup,
        ScoredGroup,
        advance,
    )

    rng = np.random.default_rng(0)
    out = []
    for g in range(args.groups):
        completions = [
            Completion(
                text="",
                token_ids=rng.integers(3, vocab, args.response, dtype=np.int32),
                logprobs=np.full(args.response, -2.0, dtype=np.float32),
                finish_reason="length",
            )
            for _ in range(args.group_size)
        ]
        rollout = advance(
            Prompt(group_id=f"g{g}", prompt_id=f"g{g}", prompt="", answer=""),
            RolloutGroup,
            prompt_ids=rng.integers(3, vocab, args.prompt, dtype=np.int32),
            policy_version=0,
            completions=completions,
        )
        scored = advance(rollout, ScoredGroup, rewards=rng.random(args.group_size, dtype=np.float32))
        out.append(advance(scored, ExperienceGroup, ref_logprobs=[c.logprobs for c in completions]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    parser.add_argument("--groups", type=int, default=2, help="groups per step (train.batch_size)")
    parser.add_argument("--group-size", type=int, default=4, help="completions per group")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per completion")
    parser.add_argument("--response", type=int, default=64, help="response tokens per completion")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model.dtype")
    parser.add_argument(
        "--master-weights",
        choices=("float32", "model_dtype"),
        default="float32",
        help="train.master_weights: float32 (the trainer's default) or model_dtype (half the optimizer's memory)",
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from services.trainer.learning.learner import Learner

    OUT.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    folder = build_model(MODEL_DIR)
    built_s = time.perf_counter() - started
    cfg = run_config(folder, args)
    learner = Learner(cfg)
    groups = groups_of(cfg, args, QWEN25_05B["vocab_size"])
    learner.step(groups, 0)  # warm-up: the optimizer's state is allocated, kernels chosen
    rows, cpu_s = [], []
    for step in range(1, args.steps + 1):
        before = time.process_time()  # this process's CPU time, all its threads: what a busy machine cannot inflate
        rows.append(MetricsRow(learner.step(groups, step)))
        cpu_s.append(time.process_time() - before)
    lengths = [args.prompt + args.response] * (args.groups * args.group_size)
    tokens = sum(lengths)
    seconds = statistics.median(row[m.STEP_TIME_S] for row in rows)
    summary = {
        "model": "Qwen2.5-0.5B shape, random weights",
        "parameters": learner.arithmetic.parameters,
        "device": args.device,
        "dtype": args.dtype,
        "master_weights": cfg.train.master_weights,
        "gradient_checkpointing": args.gradient_checkpointing,
        "threads": args.threads,
        "rows": args.groups * args.group_size,
        "tokens_per_row": args.prompt + args.response,
        "median_step_s": round(seconds, 3),
        "median_step_cpu_s": round(statistics.median(cpu_s), 3),
        "trained_tokens_per_cpu_s": round(tokens / statistics.median(cpu_s), 1),
        "trained_tokens_per_s": round(tokens / seconds, 1),
        "response_tokens_per_s": round(statistics.median(row[m.TOKENS_PER_S] for row in rows), 1),
        "model_tflop_per_s": round(learner.arithmetic.step_flops(lengths) / seconds / 1e12, 4),
        "mfu": round(statistics.median(row[m.MFU] for row in rows), 4) if m.MFU in rows[0] else None,
        "build_s": round(built_s, 1),
        "cpu": f"{cpu_model()}, {os.cpu_count()} cores",
        "load_before_after": f"{load_before:.2f} / {os.getloadavg()[0]:.2f}",
    }
    with (OUT / "learner_shape.jsonl").open("a") as out:
        out.write(json.dumps({"time": time.time(), **summary}) + "\n")
    for key, value in summary.items():
        print(f"{key:24} {value}")


if __name__ == "__main__":
    main()
