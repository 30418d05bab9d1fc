"""A tiny reward model that tells right from wrong arithmetic answers, trained by the project in seconds.

It starts from the tiny policy (``make model``), which already reads ``a+b=`` and knows roughly
what follows, with a new one-logit score head (``Qwen2ForSequenceClassification``), and is
trained with binary cross-entropy on ``prompt + answer`` pairs from the training split: the right
answer, and wrong ones that look right (off by one, by ten, digits swapped, a near miss). It
is judged on held-out prompts (``eval.jsonl``): the share whose right answer scores above a
wrong one. ``rlpipe build-reward-model`` (``make model-rm``) writes it to ``models/tiny-arith-rm``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2ForSequenceClassification

from services.common.datasets import load_jsonl

BUILD_MARKER = "reward_model_build.json"
TORCH_THREADS = 1  # the machines this builds on are small and shared; one thread is fastest per core


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer to an arithmetic prompt whose right answer is ``answer``."""
    value = int(answer)
    while True:
        kind = rng.randrange(4)
        if kind == 0:
            wrong = value + rng.choice((-1, 1))
        elif kind == 1:
            wrong = value + rng.choice((-10, 10))
        elif kind == 2 and len(answer) > 1:
            digits = list(answer)
            i = rng.randrange(len(digits) - 1)
            digits[i], digits[i + 1] = digits[i + 1], digits[i]
            wrong = int("".join(digits))
        else:
            wrong = value + rng.randint(-30, 30)
        if wrong != value and wrong >= 0:
            return str(wrong)


def labelled_pairs(rows: list[dict], rng: random.Random) -> list[tuple[str, float]]:
    """``prompt + answer`` texts with 1.0 for the right answer and 0.0 for a wrong one, one of each per row."""
    pairs = []
    for row in rows:
        pairs.append((row["prompt"] + row["answer"], 1.0))
        pairs.append((row["prompt"] + wrong_answer(row["answer"], rng), 0.0))
    return pairs


@torch.inference_mode()
def scores(model: Qwen2ForSequenceClassification, tokenizer, texts: list[str]) -> torch.Tensor:
    model.eval()
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    return model(**encoded).logits[:, 0]


def ranking_accuracy(model: Qwen2ForSequenceClassification, tokenizer, rows: list[dict], seed: int) -> float:
    """Share of ``rows`` whose right answer scores above a wrong one (0.5 is chance)."""
    rng = random.Random(seed)
    right = scores(model, tokenizer, [row["prompt"] + row["answer"] for row in rows])
    wrong = scores(model, tokenizer, [row["prompt"] + wrong_answer(row["answer"], rng) for row in rows])
    return float((right > wrong).float().mean())


def build_reward_model(
    out_dir: Path, policy_dir: Path, data_dir: Path, seed: int = 0, steps: int = 300, batch_size: int = 64
) -> dict:
    """Train the tiny reward model from the tiny policy in ``policy_dir`` and write it to ``out_dir``.

    Returns a summary with ``steps``, ``eval_ranking_accuracy``, ``seconds`` and ``reused``
    (True when ``out_dir`` already holds one built with the same settings).
    """
    out_dir, policy_dir, data_dir = Path(out_dir), Path(policy_dir), Path(data_dir)
    settings = {"seed": seed, "steps": steps, "batch_size": batch_size, "policy": str(policy_dir.resolve())}
    marker = out_dir / BUILD_MARKER
    if marker.is_file():
        recorded = json.loads(marker.read_text())
        if recorded["settings"] == settings:
            return {**recorded["summary"], "reused": True}

    started = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
        tokenizer.padding_side = "right"
        model = Qwen2ForSequenceClassification.from_pretrained(str(policy_dir), num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        train_rows = load_jsonl(data_dir / "train.jsonl")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(steps):
            model.train()
            batch = labelled_pairs(rng.sample(train_rows, batch_size // 2), rng)
            encoded = tokenizer([text for text, _ in batch], return_tensors="pt", padding=True)
            labels = torch.tensor([label for _, label in batch])
            logits = model(**encoded).logits[:, 0]  # (B,)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        accuracy = ranking_accuracy(model, tokenizer, load_jsonl(data_dir / "eval.jsonl"), seed + 1)
    finally:
        torch.set_num_threads(caller_threads)

    out_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # an interrupted rebuild is never mistaken for complete
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    summary = {"steps": steps, "eval_ranking_accuracy": accuracy, "seconds": round(time.perf_counter() - started, 2)}
    marker.write_text(json.dumps({"settings": settings, "summary": summary}, indent=2))
    return {**summary, "reused": False}
