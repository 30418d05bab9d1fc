"""A tiny reward model that tells right from wrong arithmetic answers, trained by the project in seconds.

It starts from the tiny policy (``make model``), which already reads ``a+b=`` and knows roughly
what follows, with a new one-logit score head (``Qwen2ForSequenceClassification``), and is
trained with binary cross-entropy on ``prompt + answer`` pairs from the training split: the right
answer, and a wrong one (anywhere in range, or a near miss: off by one or ten, digits swapped). It
is judged on held-out prompts (``eval.jsonl``): the share whose right answer scores above a wrong
one anywhere in range (about 0.85 after 300 steps), and above a near miss (harder: about 0.7).
``rlpipe build-reward-model`` (``make model-rm``) writes it to ``models/tiny-arith-rm``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2ForSequenceClassification

from services.common.model.datasets import load_jsonl

BUILD_MARKER = "reward_model_build.json"
TORCH_THREADS = 1  # the machines this builds on are small and shared; one thread is fastest per core


def wrong_answer(answer: str, rng: random.Random, near_miss: bool) -> str:
    """A wrong answer to an arithmetic prompt whose right answer is ``answer``.

    Anywhere in the answer's range, or a near miss (off by one or ten, two digits swapped):
    the mistakes of a policy that half knows arithmetic.
    """
    value = int(answer)
    while True:
        if not near_miss:
            wrong = rng.randint(0, max(2 * value, 20))
        elif (kind := rng.randrange(3)) == 0:
            wrong = value + rng.choice((-1, 1))
        elif kind == 1:
            wrong = value + rng.choice((-10, 10))
        else:
            digits = list(answer)
            i = rng.randrange(max(1, len(digits) - 1))
            digits[i : i + 2] = digits[i : i + 2][::-1]
            wrong = int("".join(digits))
        if wrong != value and wrong >= 0:
            return str(wrong)


def labelled_pairs(rows: list[dict], rng: random.Random) -> list[tuple[str, float]]:
    """``prompt + answer`` texts: per row the right answer (1.0) and a wrong one (0.0), a quarter near misses."""
    pairs = []
    for index, row in enumerate(rows):
        pairs.append((row["prompt"] + row["answer"], 1.0))
        pairs.append((row["prompt"] + wrong_answer(row["answer"], rng, near_miss=index % 4 == 3), 0.0))
    return pairs


@torch.inference_mode()
def scores(model: Qwen2ForSequenceClassification, tokenizer, texts: list[str]) -> torch.Tensor:
    model.eval()
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    return model(**encoded).logits[:, 0]  # (B,)


def ranking_accuracy(model, tokenizer, rows: list[dict], seed: int, near_miss: bool) -> float:
    """Share of ``rows`` whose right answer scores above a wrong one (0.5 is chance)."""
    rng = random.Random(seed)
    right = scores(model, tokenizer, [row["prompt"] + row["answer"] for row in rows])
    wrong = scores(model, tokenizer, [row["prompt"] + wrong_answer(row["answer"], rng, near_miss) for row in rows])
    return float((right > wrong).float().mean())


def build_reward_model(
    out_dir: Path,
    policy_dir: Path,
    data_dir: Path,
    seed: int = 0,
    steps: int = 300,
    batch_size: int = 64,
    learning_rate: float = 3e-4,
) -> dict:
    """Train the tiny reward model from the tiny policy in ``policy_dir`` and write it to ``out_dir``.

    Returns a summary with ``steps``, ``eval_ranking_accuracy`` (right above a wrong answer anywhere in range,
    on held-out prompts), ``eval_near_miss_accuracy`` (above a near miss), ``seconds`` and ``reused``
    (True when ``out_dir`` already holds one built with the same settings).
    """
    out_dir, policy_dir, data_dir = Path(out_dir), Path(policy_dir), Path(data_dir)
    settings = {
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "policy": str(policy_dir.resolve()),
    }
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
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
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
        eval_rows = load_jsonl(data_dir / "eval.jsonl")
        accuracy = ranking_accuracy(model, tokenizer, eval_rows, seed + 1, near_miss=False)
        near_miss_accuracy = ranking_accuracy(model, tokenizer, eval_rows, seed + 1, near_miss=True)
    finally:
        torch.set_num_threads(caller_threads)

    out_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # an interrupted rebuild is never mistaken for complete
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    summary = {
        "steps": steps,
        "eval_ranking_accuracy": accuracy,
        "eval_near_miss_accuracy": near_miss_accuracy,
        "seconds": round(time.perf_counter() - started, 2),
    }
    marker.write_text(json.dumps({"settings": settings, "summary": summary}, indent=2))
    return {**summary, "reused": False}
