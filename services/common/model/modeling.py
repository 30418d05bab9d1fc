"""Loading Hugging Face models, where and in which precision they run, and per-token logprobs of responses.

Shared by the reference (frozen model) and the trainer (policy), so both score a
response exactly the same way: logits at position t predict the token at t + 1.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from services.common.config import ModelConfig
from services.common.model import logit_math
from services.common.model.device import device_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(path: Path, dtype: str | torch.dtype = "float32") -> PreTrainedModel:
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face model at {str(path)!r} (config.json missing)")
    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    )


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


def decode_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    """The text of one sequence of ids (transformers types ``decode`` for a batch of sequences too)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    if not isinstance(text, str):
        raise TypeError(f"the tokenizer decoded one sequence of ids into {type(text).__name__}, not text")
    return text


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each layer's activations in the backward pass instead of keeping them. Non-reentrant: it needs
    no input that requires grad, and restores the RNG state so dropout draws the same masks when recomputing."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def resolve_device(name: str, cuda_available: bool | None = None) -> torch.device:
    """``model.device`` as a torch device (``device_name``); ``cuda_available`` defaults to
    ``torch.cuda.is_available()``."""
    return torch.device(device_name(name, torch.cuda.is_available() if cuda_available is None else cuda_available))


def make_deterministic(seed: int) -> None:
    """``train.deterministic`` in a process that computes with torch (the trainer, the reference, a reward model):
    torch's deterministic algorithms (a kernel that would pick its reduction order at run time, such as CUDA's
    atomic adds or cuDNN's benchmarked choice, is replaced by one that does not, and an op that has none raises
    instead of varying), and torch's, numpy's and Python's global generators started from ``seed`` (LoRA's adapter
    initialisation, a critic's value head and LoRA dropout draw from torch's). cuBLAS needs a fixed workspace for
    deterministic results, set here before its first call unless the environment set one."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(seed)  # every device's generator
    np.random.seed(seed % 2**32)
    random.seed(seed)


@dataclass(frozen=True)
class Precision:
    """Where a model runs and in which dtypes: parameters stored in ``param_dtype``, matmuls in ``compute_dtype``.

    With fp32 master weights (``param_dtype`` float32, ``compute_dtype`` bfloat16) the module
    stays float32 and ``autocast()`` runs its forward (and so its backward) in bfloat16: the
    optimizer updates float32 weights, so a step smaller than bfloat16's resolution is not lost.
    """

    device: torch.device
    param_dtype: torch.dtype
    compute_dtype: torch.dtype

    @classmethod
    def of(
        cls, model: ModelConfig, master_weights: str = "model_dtype", cuda_available: bool | None = None
    ) -> Precision:
        """``master_weights``: "float32" keeps parameters in float32 (the trainer), "model_dtype" stores them in
        ``model.dtype`` (frozen models: reference, rollout)."""
        compute = DTYPES[model.dtype]
        param = torch.float32 if master_weights == "float32" else compute
        return cls(resolve_device(model.device, cuda_available), param, compute)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed precision when the parameters are wider than the compute dtype; else nothing to do."""
        if self.compute_dtype == self.param_dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)


def to_host(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, floating point cast to ``dtype`` if given; never shares its storage.

    The cast (when the tensor is on a GPU) happens inside the copy, so the GPU holds at most
    one extra tensor of this size, never a second copy of a whole model.
    """
    tensor = tensor.detach()
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return torch.empty(tensor.shape, dtype=target, device="cpu").copy_(tensor)


def host_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``state`` (a module's state dict) copied to host memory one tensor at a time (see ``to_host``)."""
    return {name: to_host(tensor, dtype) for name, tensor in state.items()}


def host_copy(value: Any) -> Any:
    """A deep copy of nested state (an optimizer's ``state_dict()``) with every tensor copied to host memory,
    one at a time: ``copy.deepcopy`` would clone GPU tensors on the GPU, a second copy of the optimizer state."""
    if isinstance(value, torch.Tensor):
        return to_host(value)
    if isinstance(value, dict):
        return {key: host_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(item) for item in value)
    return value  # ints, floats, strings, None and bools are immutable


@dataclass
class ResponseBatch:
    """Prompt+response sequences, right-padded, with the response laid out as ``[batch, response_len]``."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    prompt_lens: torch.Tensor  # [B]
    targets: torch.Tensor  # [B, R] response token ids (pad past the end)
    mask: torch.Tensor  # [B, R] 1.0 on real response tokens

    def to(self, device: torch.device) -> ResponseBatch:
        return ResponseBatch(
            *(t.to(device) for t in (self.input_ids, self.attention_mask, self.prompt_lens, self.targets, self.mask))
        )


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


def split_by_tokens(
    rows: torch.Tensor, lengths: torch.Tensor, budget: int, setting: str = "train.micro_batch_tokens"
) -> list[torch.Tensor]:
    """Length-sorted micro-batches of ``rows`` whose padded size fits ``budget`` tokens.

    ``lengths[i]`` is row ``rows[i]``'s prompt + response length. Rows are sorted longest first
    (a stable sort: the split depends only on the rows and their lengths) and cut greedily: a
    micro-batch whose first, longest row has length L takes rows while n * L <= budget. Each
    micro-batch pads to its own longest row, so short sequences stop padding to the step's longest. ``setting``
    names the budget in the error a sequence longer than it gets.
    """
    order = torch.argsort(lengths, descending=True, stable=True)
    longest_first, sorted_lengths = rows[order], lengths[order].tolist()
    if sorted_lengths and sorted_lengths[0] > budget:
        raise ValueError(
            f"{setting} ({budget}) is smaller than one sequence of {sorted_lengths[0]} tokens "
            "(prompt + response): it must hold the longest sequence, max_seq_len"
        )
    micro_batches, start = [], 0
    for i in range(1, len(sorted_lengths)):
        if (i - start + 1) * sorted_lengths[start] > budget:
            micro_batches.append(longest_first[start:i])
            start = i
    if sorted_lengths:
        micro_batches.append(longest_first[start:])
    return micro_batches


def at_response(per_position: torch.Tensor, batch: ResponseBatch, first_position: int = 0) -> torch.Tensor:
    """``[B, L, ...]`` outputs taken at the positions that predict each response token: ``[B, R, ...]``.

    ``first_position``: the sequence position ``per_position``'s first column holds (its last columns only, as
    ``response_window`` keeps them)."""
    width = batch.targets.shape[1]
    steps = torch.arange(width, device=per_position.device)
    positions = (batch.prompt_lens.to(per_position.device)[:, None] - 1 - first_position + steps[None, :]).clamp(
        max=per_position.shape[1] - 1
    )
    index = positions.view(*positions.shape, *([1] * (per_position.dim() - 2)))
    return per_position.gather(1, index.expand(-1, -1, *per_position.shape[2:]))


def response_window(batch: ResponseBatch) -> int:
    """How many of the last positions hold every prediction of a response token: from the shortest prompt's last
    token to the end. A causal LM asked for ``logits_to_keep`` of them projects only those onto the vocabulary,
    so no ``[B, L, V]`` logits are made for the prompts (most of the positions with a chat template, and the
    vocabulary projection is a fifth of SmolLM2's per-token work)."""
    return batch.input_ids.shape[1] - int(batch.prompt_lens.min()) + 1


def window_logits(logits: torch.Tensor, batch: ResponseBatch) -> torch.Tensor:
    """The response's logits ``[B, R, V]`` out of a forward pass asked for ``response_window(batch)`` positions."""
    return at_response(logits, batch, first_position=batch.input_ids.shape[1] - logits.shape[1])


def response_logits(model: PreTrainedModel, batch: ResponseBatch) -> torch.Tensor:
    """Logits that predict each response token: ``[B, R, vocab]``."""
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        use_cache=False,
        logits_to_keep=response_window(batch),
    )
    return window_logits(output.logits, batch)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, computed in float32 for stability, a few rows at a time
    (``logit_math.token_logprobs``: no float32 copy of the whole ``[B, R, V]`` logits)."""
    return logit_math.token_logprobs(logits, targets)
