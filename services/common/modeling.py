"""Loading Hugging Face models and computing per-token logprobs of responses.

Shared by the reference (frozen model) and the trainer (policy), so both score a
response exactly the same way: logits at position t predict the token at t + 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(path: Path, dtype: str = "float32") -> PreTrainedModel:
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face model at {str(path)!r} (config.json missing)")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


@dataclass
class ResponseBatch:
    """Prompt+response sequences, right-padded, with the response laid out as ``[batch, response_len]``."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    prompt_lens: torch.Tensor  # [B]
    targets: torch.Tensor  # [B, R] response token ids (pad past the end)
    mask: torch.Tensor  # [B, R] 1.0 on real response tokens


def pack(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> ResponseBatch:
    """Pack (prompt ids, response ids) pairs. Lengths were bounded at generation time (max_seq_len)."""
    length = max(len(p) + len(r) for p, r in pairs)
    width = max(max(len(r) for _, r in pairs), 1)
    batch = len(pairs)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    targets = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.float32)
    for i, (prompt, response) in enumerate(pairs):
        n = len(prompt) + len(response)
        input_ids[i, :n] = torch.tensor(prompt + response, dtype=torch.long)
        attention[i, :n] = 1
        targets[i, : len(response)] = torch.tensor(response, dtype=torch.long)
        mask[i, : len(response)] = 1.0
    prompt_lens = torch.tensor([len(p) for p, _ in pairs], dtype=torch.long)
    return ResponseBatch(input_ids, attention, prompt_lens, targets, mask)


def at_response(per_position: torch.Tensor, batch: ResponseBatch) -> torch.Tensor:
    """``[B, L, ...]`` outputs taken at the positions that predict each response token: ``[B, R, ...]``."""
    width = batch.targets.shape[1]
    positions = (batch.prompt_lens[:, None] - 1 + torch.arange(width)[None, :]).clamp(max=per_position.shape[1] - 1)
    index = positions.view(*positions.shape, *([1] * (per_position.dim() - 2)))
    return per_position.gather(1, index.expand(-1, -1, *per_position.shape[2:]))


def response_logits(model: PreTrainedModel, batch: ResponseBatch) -> torch.Tensor:
    """Logits that predict each response token: ``[B, R, vocab]``."""
    return at_response(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, computed in float32 for stability."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
