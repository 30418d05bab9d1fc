"""Many continuations in one transformers ``generate`` call: contexts of any lengths, each row ending on its own.

The rows are left-padded into one batch (``padding.left_padded``: attention mask and per-row position ids), so no
row sees another's padding and a row's tokens are those it would get alone, to float rounding. Each row ends at its
first end token, once its new text holds one of ``stop`` (the token completing it kept, as vLLM's
``include_stop_str_in_output`` keeps it), or at its own token limit, whichever comes first; the batch runs until
every row has ended. ``generate`` fills a finished row with the pad token, which may be the EOS itself
(``padding.pad_token_id``), so where each row ended is recorded as it ends rather than read back from the tokens.

Each sampled token's logprob is taken as it is drawn, under the raw policy (before temperature and top-p, as the
trainer computes it): one ``[B, V]`` log-softmax at a time, not the ``[B, T, V]`` stack ``output_logits`` keeps
(6 GB of float32 for 128 rows of 256 tokens over SmolLM2's 49,152-token vocabulary).

With ``static`` (``static_cache.StaticCaches``) ``generate`` runs over a static KV cache the caller keeps, one per
batch size, reused call after call; on a CUDA device transformers then compiles the decode step, with CUDA graphs,
one per shape. So a call's shapes are rounded: its rows up to their batch bucket, with copies of its first row that
end after one token and whose outputs are dropped (each row is its own under the mask, so the copies change no real
row's logprobs; the copies draw from the call's generator too, so a sampled call's real rows get other random numbers
than without them, from the same distributions); its width and token limit up to multiples of ``bucket_tokens``; and
the cache is as long as the longest call so far needed.

Used by the transformers rollout engine (sampled) and the trainer's held-out evaluation (greedy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from services.common.model.modeling import Precision
from services.common.model.padding import left_padded
from services.common.model.static_cache import StaticCaches


@dataclass(frozen=True)
class Continuation:
    """One row's new tokens, their logprobs under the raw policy, and whether it ended on an end token or a stop
    string (else it ran out of its token limit)."""

    token_ids: list[int]
    logprobs: np.ndarray  # float32 [T]
    stopped: bool


class _RawLogprobs(LogitsProcessor):
    """Keeps the step's log-softmax of the logits it is given. transformers runs the processors a caller passes
    ahead of its sampling warpers (temperature, top-k, top-p), after only those the model's generation config asks
    for (repetition penalties and the like, which no model rlpipe builds or imports sets): the model's raw logits."""

    def __init__(self) -> None:
        self.current: torch.Tensor | None = None  # (B, V) float32

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.current = scores.float().log_softmax(-1)
        return scores


class _RowEnds(StoppingCriteria):
    """After each step: the drawn token's logprob, and which rows end there (end token, stop string, own limit)."""

    def __init__(
        self,
        width: int,
        limits: list[int],
        end_tokens: Collection[int],
        stop: Sequence[str],
        decode: Callable[[list[int]], str] | None,
        raw: _RawLogprobs,
        device: torch.device,
    ):
        self.width, self.stop, self.decode, self.raw = width, list(stop), decode, raw
        self.limits = torch.tensor(limits, device=device)
        self.end_ids = torch.tensor(sorted(end_tokens), dtype=torch.long, device=device)
        self.ends = torch.zeros(len(limits), dtype=torch.long, device=device)  # new tokens kept; 0 = still going
        self.stopped = torch.zeros(len(limits), dtype=torch.bool, device=device)
        self.logprobs: list[torch.Tensor] = []  # one (B,) per step
        # A stop string that first appears with the newest token lies within its last len(s) tokens (every token
        # decodes to a character at least, a broken UTF-8 byte to U+FFFD), so only that window is decoded each
        # step: the cost stays flat however long the rows grow.
        self.window = max((len(s) for s in self.stop), default=0) + 1

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        new = input_ids.shape[1] - self.width  # tokens generated so far, the one just drawn included
        token = input_ids[:, -1]  # (B,)
        if self.raw.current is None:
            raise RuntimeError("the stopping criteria ran before the logits processor: no logprobs for this token")
        self.logprobs.append(self.raw.current.gather(-1, token[:, None])[:, 0])
        running = self.ends == 0
        ended = running & torch.isin(token, self.end_ids)
        if self.stop:
            candidates = (running & ~ended).nonzero()[:, 0]
            tails = input_ids[candidates, max(self.width, input_ids.shape[1] - self.window) :].tolist()
            hits = [row for row, tail in zip(candidates.tolist(), tails, strict=True) if self._holds_stop(tail)]
            if hits:
                ended[hits] = True
        self.stopped |= ended
        ended |= running & (new >= self.limits)
        self.ends[ended] = new
        return self.ends > 0

    def _holds_stop(self, tokens: list[int]) -> bool:
        if self.decode is None:  # generate_batch refuses stop strings without a decode
            raise ValueError("stop strings need a decode")
        text = self.decode(tokens)
        return any(s in text for s in self.stop)


def _one_call(
    model: Any,
    contexts: list[list[int]],
    limits: list[int],
    pad_id: int,
    end_tokens: Collection[int],
    stop: Sequence[str],
    decode: Callable[[list[int]], str] | None,
    sampling: dict[str, Any],
    static: StaticCaches | None,
) -> list[Continuation]:
    real = len(contexts)
    multiple = 1 if static is None else static.bucket_tokens
    if static is not None:
        # Filler rows up to the batch bucket: copies of the first row that end after one token, so they never
        # lengthen the call; their outputs are cut off below.
        filler = static.rows_for(real) - real
        contexts, limits = contexts + [contexts[0]] * filler, limits + [1] * filler
    input_ids, attention_mask, position_ids = (t.to(model.device) for t in left_padded(contexts, pad_id, multiple))
    # Width and max_new_tokens both rounded to the bucket, so that calls of like prompts and limits share the cache's
    # length. Each row still ends at its own limit (_RowEnds).
    room = -(-max(limits) // multiple) * multiple
    width = input_ids.shape[1]
    cache = {} if static is None else {"past_key_values": static.cache(len(contexts), width + room)}
    raw = _RawLogprobs()
    ends = _RowEnds(width, limits, end_tokens, stop, decode, raw, model.device)
    sequences = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **sampling,
        max_new_tokens=room,
        logits_processor=LogitsProcessorList([raw]),
        stopping_criteria=StoppingCriteriaList([ends]),
        pad_token_id=pad_id,
        eos_token_id=sorted(end_tokens) or None,  # an empty list is not 'none' to generate
        **cache,
    )
    new_tokens = sequences[:real, width:].tolist()  # (real, steps)
    logprobs = torch.stack(ends.logprobs, dim=1)[:real].float().cpu().numpy()  # (real, steps)
    return [
        Continuation(tokens[:end], logprobs[row, :end].astype(np.float32), stopped)
        for row, (tokens, end, stopped) in enumerate(
            zip(new_tokens, ends.ends[:real].tolist(), ends.stopped[:real].tolist(), strict=True)
        )
    ]


def calls(lengths: list[int], max_per_call: int | None) -> list[list[int]]:
    """The row indices each call takes: all in one, or, above ``max_per_call``, rows of like length together
    (sorted by length, stably, then cut), so a call pads its rows to little more than their own length."""
    if max_per_call is None or len(lengths) <= max_per_call:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    return [order[start : start + max_per_call] for start in range(0, len(order), max_per_call)]


def generate_batch(
    model: Any,
    contexts: list[list[int]],
    limits: list[int],
    *,
    pad_id: int,
    end_tokens: Collection[int],
    stop: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_per_call: int | None = None,
    precision: Precision | None = None,
    static: StaticCaches | None = None,
) -> list[Continuation]:
    """One continuation of each of ``contexts``, at most ``limits[i]`` tokens, in as few ``generate`` calls as
    ``max_per_call`` allows (None: one). ``temperature`` 0 decodes greedily; above it samples from
    ``softmax(z / temperature)`` cut to ``top_p``, over the whole vocabulary (no top-k). ``stop`` needs ``decode``
    (token ids -> text). ``precision``: run under its autocast (a trainer's fp32 master weights). ``static``: the
    static KV caches to generate over, None for transformers' dynamic cache (module docstring).

    The model runs where it is, in eval mode, without autograd (no_grad rather than inference_mode: a trainer's
    model trains on afterwards, and FSDP2 refills the parameters it gathered here in place)."""
    if not contexts:
        return []
    if len(limits) != len(contexts) or min(limits) < 1:
        raise ValueError(f"each context needs a limit of 1 token or more, got {limits} for {len(contexts)} contexts")
    if stop and decode is None:
        raise ValueError("stop strings need decode (token ids -> text) to be found")
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
        if temperature > 0
        else {"do_sample": False}
    )
    results: list[Continuation] = [None] * len(contexts)  # type: ignore[list-item]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), precision.autocast() if precision else contextlib.nullcontext():
            for rows in calls([len(c) for c in contexts], max_per_call):
                done = _one_call(
                    model,
                    [contexts[i] for i in rows],
                    [limits[i] for i in rows],
                    pad_id,
                    end_tokens,
                    stop,
                    decode,
                    sampling,
                    static,
                )
                for i, continuation in zip(rows, done, strict=True):
                    results[i] = continuation
    finally:
        model.train(was_training)
    return results
