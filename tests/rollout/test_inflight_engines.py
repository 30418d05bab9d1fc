"""In-flight weight updates on the real engines (rollout.inflight_updates): new weights loaded between two chunks of
a sample, the sample goes on from its kept tokens, and every token's recorded logprob is the one the version it is
tagged with gives it — the old weights' before the load, the new weights' after, over the whole context."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from services.common.model.modeling import load_model
from services.rollout.engines import build_engine
from services.rollout.partial import PartialSample, generate_in_chunks, newest_version
from tests.support.runs import run_config

pytestmark = pytest.mark.integration

PROMPTS = ["12+34=", "7+8="]
CHUNK = 1  # the tiny model answers in two or three tokens: the load comes after the first


def perturbed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights moved enough that every token's logprob changes by far more than the tolerance."""
    generator = torch.Generator().manual_seed(5)
    return {
        name: tensor + 0.5 * tensor.float().std().nan_to_num() * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }


def scored(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The model's logprob of each of ``tokens`` after ``prompt`` and the tokens before it."""
    sequence = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = model(sequence).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(-1, sequence[0, 1:, None])[:, 0].numpy()[len(prompt) - 1 :]


# The engines compute logprobs with their own kernels: transformers' match a forward pass to float32 rounding.
@pytest.mark.parametrize(("backend", "tolerance"), [("hf", 1e-4), ("vllm", 2e-2)])
def test_a_sample_continued_across_a_weight_load_has_each_tokens_logprob_from_the_version_it_is_tagged_with(
    tiny_model, tmp_path, backend, tolerance
):
    model_dir, _ = tiny_model
    rollout = {"backend": backend, "kv_cache_mib": 48, "inflight_updates": True, "inflight_chunk_tokens": CHUNK}
    cfg = run_config(tmp_path, tiny_model, rollout=rollout)
    engine = build_engine(cfg)
    base = load_model(model_dir, "float32").eval()
    moved = load_model(model_dir, "float32").eval()
    moved.load_state_dict(perturbed(base))
    sampling = cfg.sampling.model_copy(update={"temperature": 1.0, "top_p": 1.0})
    prompts = [engine.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    samples = [PartialSample(ids, limit=6) for ids in prompts for _ in range(2)]
    version = 0

    async def chunk(contexts: list[list[int]], rooms: list[int]):
        nonlocal version
        if version == 0 and any(sample.tokens for sample in samples):  # the trainer published version 1
            engine.load_weights(iter(perturbed(base).items()))
            version = 1
        generations = engine.generate_turns(contexts, rooms, sampling, [])
        for generation in generations:
            generation.policy_version = version
        return generations

    asyncio.run(generate_in_chunks(samples, CHUNK, chunk))
    straddling = [s for s in samples if 0 in s.versions and 1 in s.versions]
    assert straddling, "no sample went on past the load: the test proves nothing"
    assert newest_version(samples, loaded=0) == 1
    gaps = []
    for sample in samples:
        versions = np.asarray(sample.versions)
        assert sample.versions == sorted(sample.versions)  # a later token never from an older version
        assert (versions[:CHUNK] == 0).all()  # the first chunk was sampled before the load
        old, new = scored(base, sample.prompt, sample.tokens), scored(moved, sample.prompt, sample.tokens)
        recorded = np.asarray(sample.logprobs)
        expected = np.where(versions == 0, old, new)
        np.testing.assert_allclose(recorded, expected, atol=tolerance)
        gaps.append(np.abs(old - new)[versions == 1])
    # The versions score the tokens after the load far apart: had the engine kept the old weights (or their cached
    # keys and values), the check above would have failed.
    assert np.concatenate(gaps).max() > 10 * tolerance
