"""Greedy decoding and exact-match accuracy for Hugging Face causal LMs."""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from services.common.model.answers import ends_on_answer
from services.common.model.modeling import Precision


def greedy_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int = 256,
    precision: Precision | None = None,
) -> list[str]:
    """Greedily complete each prompt and return the text before the first EOS.

    Prompts are left-padded so every row's last prompt token sits at the same
    position, which is where ``generate`` appends new tokens. The model runs where it is
    (``model.device``); with ``precision`` (a trainer's fp32 master weights) under its autocast,
    so held-out accuracy is measured in the dtype the rollouts sample in.
    """
    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    completions = []
    try:
        for start in range(0, len(prompts), batch_size):
            encoded = [
                tokenizer.encode(prompt, add_special_tokens=False) for prompt in prompts[start : start + batch_size]
            ]
            width = max(len(ids) for ids in encoded)
            input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in encoded])
            attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
            # no_grad, not inference_mode: the model trains on afterwards, and FSDP2 refills the unsharded
            # parameters it gathered here in place, which an inference tensor refuses.
            with torch.no_grad(), precision.autocast() if precision else contextlib.nullcontext():
                output = model.generate(
                    input_ids=input_ids.to(model.device),
                    attention_mask=attention_mask.to(model.device),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=pad_id,
                    eos_token_id=eos_id,
                )
            for new_ids in output[:, width:].tolist():
                if eos_id in new_ids:
                    new_ids = new_ids[: new_ids.index(eos_id)]
                completions.append(tokenizer.decode(new_ids, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return completions


def strict_match(completion: str, answer: str) -> bool:
    """True when the whole completion is the answer (ignoring surrounding whitespace): stricter than the
    exact_match reward, so held-out accuracy cannot be gamed by text around a right number."""
    return completion.strip() == answer.strip()


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    max_new_tokens: int,
    precision: Precision | None = None,
) -> float:
    """Fraction of ``rows`` whose greedy completion of ``prompt`` matches ``answer`` (``precision``: see
    ``greedy_generate``)."""
    if not rows:
        raise ValueError("greedy_accuracy needs at least one row")
    prompts = [row["prompt"] for row in rows]
    completions = greedy_generate(model, tokenizer, prompts, max_new_tokens, precision=precision)
    correct = sum(answered(c, row) for c, row in zip(completions, rows, strict=False))
    return correct / len(rows)


def answered(completion: str, row: dict) -> bool:
    """A chat row is answered in a sentence whose final number must be the answer; a plain row by the answer alone."""
    if "messages" in row:
        return ends_on_answer(completion, row["answer"])
    return strict_match(completion, row["answer"])
