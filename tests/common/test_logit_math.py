"""The chunked log-probabilities and entropy give the plain formulas' values and gradients.

Tolerances: float64 inputs are compared to 1e-12 (the two differ only in summation order); float32 inputs
to the float64 plain formula at 1e-5 absolute (a few float32 ulps of the logits' scale); bfloat16 logits to
the plain formula run on the same bfloat16 values upcast to float32, values at 1e-5 and gradients at 2e-2
(the gradient is rounded back to bfloat16, 8 significant bits).
"""

import pytest
import torch

from services.common.model import logit_math
from services.common.model.logit_math import entropy, token_logprobs

pytestmark = pytest.mark.unit


def plain_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def plain_entropy(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def draw(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=generator, dtype=torch.float64) * 4).to(dtype)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=generator)
    return logits, targets


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 rows for a vocabulary of 50, so a [4, 5, 50] batch crosses 7 chunk boundaries."""
    monkeypatch.setattr(logit_math, "CHUNK_ELEMENTS", 150)


def values_and_gradient(fn, logits: torch.Tensor, *args, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.detach().clone().requires_grad_(True)
    out = fn(leaf, *args)
    (out * weights).sum().backward()
    return out.detach(), leaf.grad


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("shape", [(4, 5, 50), (7, 50), (50,)])
def test_float64_logprobs_and_entropy_equal_the_plain_formulas_with_their_gradients(shape):
    logits, targets = draw(shape, torch.float64)
    weights = torch.randn(shape[:-1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got, got_grad = values_and_gradient(token_logprobs, logits, targets, weights=weights)
    want, want_grad = values_and_gradient(plain_logprobs, logits, targets, weights=weights)
    assert got.dtype == torch.float64 and got.shape == shape[:-1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12)

    got, got_grad = values_and_gradient(entropy, logits, weights=weights)
    want, want_grad = values_and_gradient(plain_entropy, logits, weights=weights)
    assert got.shape == shape[:-1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12)


@pytest.mark.usefixtures("small_chunks")
def test_float32_logits_give_the_float64_formulas_to_float32_precision():
    logits, targets = draw((4, 5, 50), torch.float32)
    weights = torch.randn((4, 5), generator=torch.Generator().manual_seed(2))
    got, got_grad = values_and_gradient(token_logprobs, logits, targets, weights=weights)
    want, want_grad = values_and_gradient(plain_logprobs, logits.double(), targets, weights=weights.double())
    assert got.dtype == torch.float32 and got_grad.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=0, atol=1e-5)

    got, got_grad = values_and_gradient(entropy, logits, weights=weights)
    want, want_grad = values_and_gradient(plain_entropy, logits.double(), weights=weights.double())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=0, atol=1e-5)


@pytest.mark.usefixtures("small_chunks")
def test_bfloat16_logits_are_scored_in_float32_and_get_a_bfloat16_gradient():
    logits, targets = draw((4, 5, 50), torch.bfloat16)
    weights = torch.randn((4, 5), generator=torch.Generator().manual_seed(3))
    got, got_grad = values_and_gradient(token_logprobs, logits, targets, weights=weights)
    want, want_grad = values_and_gradient(plain_logprobs, logits.float(), targets, weights=weights)
    assert got.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_grad.float(), want_grad, rtol=0, atol=2e-2)

    got, got_grad = values_and_gradient(entropy, logits, weights=weights)
    want, want_grad = values_and_gradient(plain_entropy, logits.float(), weights=weights)
    assert got.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_grad.float(), want_grad, rtol=0, atol=2e-2)


def test_a_peaked_distribution_has_log_probability_zero_and_entropy_zero():
    logits = torch.tensor([[200.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert token_logprobs(logits, torch.tensor([0, 2])).tolist() == pytest.approx([0.0, -1.0986123], abs=1e-6)
    assert entropy(logits).tolist() == pytest.approx([0.0, 1.0986123], abs=1e-6)


def test_chunks_cover_every_row_once_and_hold_at_most_the_budget(monkeypatch):
    monkeypatch.setattr(logit_math, "CHUNK_ELEMENTS", 100)
    chunks = logit_math._row_chunks(10, 30)
    assert [(c.start, c.stop) for c in chunks] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # A vocabulary larger than the budget still takes one row at a time.
    assert len(logit_math._row_chunks(4, 1000)) == 4
