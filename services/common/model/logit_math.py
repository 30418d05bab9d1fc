"""Per-token log-probabilities and entropy over a large vocabulary without a float32 copy of all the logits.

The plain formulas, ``log_softmax(z.float()).gather(t)`` and ``logsumexp(z) - sum(softmax(z) * z)``, hold
several whole ``[B, R, V]`` float32 tensors at once, and autograd keeps them until the backward pass. With
SmolLM2's 49,152-token vocabulary, 32 sequences of 40 response tokens make each such tensor 250 MB, and the
trainer and reference peaked on them. Here each formula runs over a few rows at a time (at most
``CHUNK_ELEMENTS`` logits), keeps only the per-row log-sum-exp for the backward pass, and recomputes the
softmax there chunk by chunk. So beyond the logits themselves and their gradient (the same shape and dtype
as the logits), the extra memory is one chunk's float32 softmax.

Both are exact rewrites of the plain formulas (same values and gradients to float rounding; the unit tests
compare them): log p(t) = z_t - lse(z), and H = lse(z) - sum_j p_j z_j with dH/dz_j = -p_j (z_j - sum_k p_k z_k).
"""

from __future__ import annotations

import torch

# 2 Mi float32 logits (8 MiB) per chunk: enough rows (42 of SmolLM2's) that the loop costs nothing next to the
# matrix products that made the logits. 32 MiB chunks measured a higher peak (bench/logit_memory.py: 1.6x
# the logits over them against 1.25x), as each chunk's temporaries then left the heap larger.
CHUNK_ELEMENTS = 1 << 21


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 at least (bfloat16 logits lose the small differences log-softmax is about), float64 kept."""
    return torch.promote_types(dtype, torch.float32)


def _row_chunks(rows: int, vocab: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits (N, V), targets (N,) -> log p(target) (N,) in the compute dtype
        dtype = _compute_dtype(logits.dtype)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        picked = logits.gather(-1, targets[:, None]).squeeze(-1).to(dtype)  # (N,)
        for rows in _row_chunks(logits.shape[0], logits.shape[1]):
            lse[rows] = torch.logsumexp(logits[rows].to(dtype), dim=-1)
        ctx.save_for_backward(logits, targets, lse)
        return picked - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for rows in _row_chunks(logits.shape[0], logits.shape[1]):
            g = grad[rows, None]  # (n, 1)
            # d log p(t) / dz_j = 1[j = t] - p_j
            chunk = torch.exp(logits[rows].to(lse.dtype) - lse[rows, None]).mul_(-g)  # (n, V)
            chunk.scatter_add_(-1, targets[rows, None], g)
            grad_logits[rows] = chunk.to(logits.dtype)
        return grad_logits, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        # logits (N, V) -> entropy (N,) in the compute dtype
        dtype = _compute_dtype(logits.dtype)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        mean_logit = torch.empty_like(lse)  # E_p[z] per row
        for rows in _row_chunks(logits.shape[0], logits.shape[1]):
            z = logits[rows].to(dtype)  # (n, V)
            lse[rows] = torch.logsumexp(z, dim=-1)
            mean_logit[rows] = (torch.exp(z - lse[rows, None]) * z).sum(-1)
        ctx.save_for_backward(logits, lse, mean_logit)
        return lse - mean_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        logits, lse, mean_logit = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for rows in _row_chunks(logits.shape[0], logits.shape[1]):
            z = logits[rows].to(lse.dtype)  # (n, V)
            # dH/dz_j = -p_j (z_j - E_p[z])
            chunk = torch.exp(z - lse[rows, None]).mul_(z - mean_logit[rows, None]).mul_(-grad[rows, None])
            grad_logits[rows] = chunk.to(logits.dtype)
        return grad_logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position: ``logits [..., V]``, ``targets [...]`` -> ``[...]`` in float32 (float64
    logits stay float64), without a float32 copy of all the logits."""
    vocab = logits.shape[-1]
    flat = _TokenLogprobs.apply(logits.reshape(-1, vocab), targets.reshape(-1))
    return flat.view(targets.shape)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: ``[..., V]`` -> ``[...]`` in float32 (float64 stays
    float64), without a float32 copy of all the logits."""
    vocab = logits.shape[-1]
    return _Entropy.apply(logits.reshape(-1, vocab)).view(logits.shape[:-1])
