"""Greedy decoding and exact-match accuracy for Hugging Face causal LMs."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from services.common.config import DataConfig
from services.common.model.answers import ends_on_answer
from services.common.model.batch_generation import generate_batch
from services.common.model.modeling import Precision, decode_text
from services.common.model.padding import eos_token_id, pad_token_id

# The run's default (data.eval_batch_size), so an accuracy computed outside a run chunks as the trainer's does.
EVAL_BATCH_SIZE = DataConfig.model_fields["eval_batch_size"].default


def greedy_generate(
    model: torch.nn.Module,  # a transformers model, or peft's wrapper of one
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int = EVAL_BATCH_SIZE,
    precision: Precision | None = None,
) -> list[str]:
    """Greedily complete each prompt and return the text before the first EOS.

    ``batch_size`` prompts per ``generate`` call (of like length together), left-padded with ``pad_token_id``'s
    fallback under an attention mask (``batch_generation.generate_batch``). The model runs where it is
    (``model.device``); with ``precision`` (a trainer's fp32 master weights) under its autocast, so held-out
    accuracy is measured in the dtype the rollouts sample in.
    """
    eos_id = eos_token_id(tokenizer)
    encoded = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in prompts]
    continuations = generate_batch(
        model,
        encoded,
        [max_new_tokens] * len(encoded),
        pad_id=pad_token_id(tokenizer),
        end_tokens=() if eos_id is None else (eos_id,),
        max_per_call=batch_size,
        precision=precision,
    )
    return [
        decode_text(tokenizer, c.token_ids[:-1] if c.stopped else c.token_ids, skip_special_tokens=True)
        for c in continuations
    ]


def strict_match(completion: str, answer: str) -> bool:
    """True when the whole completion is the answer (ignoring surrounding whitespace): stricter than the
    exact_match reward, so held-out accuracy cannot be gamed by text around a right number."""
    return completion.strip() == answer.strip()


def greedy_accuracy(
    model: torch.nn.Module,  # a transformers model, or peft's wrapper of one
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    max_new_tokens: int,
    precision: Precision | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
) -> float:
    """Fraction of ``rows`` whose greedy completion of ``prompt`` matches ``answer`` (``precision``,
    ``batch_size``: see ``greedy_generate``)."""
    if not rows:
        raise ValueError("greedy_accuracy needs at least one row")
    prompts = [row["prompt"] for row in rows]
    completions = greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size, precision)
    correct = sum(answered(c, row) for c, row in zip(completions, rows, strict=False))
    return correct / len(rows)


def answered(completion: str, row: dict) -> bool:
    """A chat row is answered in a sentence whose final number must be the answer; a plain row by the answer alone."""
    if "messages" in row:
        return ends_on_answer(completion, row["answer"])
    return strict_match(completion, row["answer"])
