"""What rlpipe pads with, for tokenizers that name no pad token (a GGUF import under some transformers versions).

Every padded batch rlpipe builds carries an attention mask that hides the padding (and, left-padded for
generation, position ids counted over the real tokens only), so which id fills the gaps changes no logit of a real
token: it only has to be an id the model's embedding holds. The fallback, in order: the tokenizer's pad token, else
its end-of-sequence token, else its unknown token. The trainer's packing and evaluation, the reference, both
engines' batches, the reward model and ``rlpipe import-gguf`` all take it from ``pad_token_id``.
"""

from __future__ import annotations

from typing import Any

import torch

PAD_FALLBACK = ("pad_token_id", "eos_token_id", "unk_token_id")


def eos_token_id(tokenizer: Any) -> int | None:
    """The tokenizer's end-of-sequence id, None without one. transformers serves the special-token ids through
    ``__getattr__``, typed as any special-token value (ids or texts); an ``*_token_id`` is one id."""
    value = getattr(tokenizer, "eos_token_id", None)
    return None if value is None else int(value)


def pad_token_id(tokenizer: Any) -> int:
    """The id to pad with: ``tokenizer.pad_token_id``, else its ``eos_token_id``, else its ``unk_token_id``.

    Raises ValueError when the tokenizer has none of the three: nothing safe is left to pad with."""
    for name in PAD_FALLBACK:
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise ValueError(
        f"the tokenizer ({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r}) has no pad, "
        "end-of-sequence or unknown token to pad batches with; give it a pad token (tokenizer_config.json)"
    )


def ensure_pad_token(tokenizer: Any) -> Any:
    """``tokenizer`` with its pad token set to ``pad_token_id``'s fallback when it had none (in place; returned),
    for the code that pads through the tokenizer itself (``tokenizer(texts, padding=True)``, ``save_pretrained``)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_token_id(tokenizer))
    return tokenizer


def left_padded(
    rows: list[list[int]], pad_id: int, multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` of different lengths as one batch ending at the same column, where ``generate`` appends:
    (input_ids, attention_mask, position_ids), each ``[B, width]``, ``width`` the longest row rounded up to a
    ``multiple`` (batches of like rows then share one shape). A row's positions count its own tokens from 0, so its
    first token sits at position 0 however much padding precedes it; padding gets position 0 and mask 0."""
    width = -(-max(len(ids) for ids in rows) // multiple) * multiple
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + list(ids) for ids in rows], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], dtype=torch.long)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, width)
    return input_ids, attention_mask, position_ids
