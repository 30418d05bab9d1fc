"""The transformers engine on the tiny model: a batch's prompts x group_size in one ``generate`` call, every live
episode's turn in one call, each sequence with the tokens and logprobs it gets alone (float noise apart), stops
honoured per sequence, and a tokenizer without a pad token."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.config import SamplingConfig
from services.common.model.batch_generation import generate_batch
from services.common.model.datasets import load_jsonl
from services.common.model.modeling import load_model
from services.rollout.engines import HfEngine
from tests.support.padless import without_pad_token
from tests.support.runs import run_config
from tests.support.weights import trainer_logprobs

pytestmark = pytest.mark.integration

PROMPTS, GROUP = 16, 8
# float32 on the CPU: a padded batch multiplies in other shapes than a lone row (3e-6 seen).
TOLERANCE = 1e-4


def sampling(**update) -> SamplingConfig:
    """The run's sampling settings: GROUP samples of at most 6 tokens at temperature 1 unless ``update`` says."""
    return SamplingConfig(group_size=GROUP, max_new_tokens=6, **update)


def engine_for(model_dir, data_dir, tmp_path, **hf) -> HfEngine:
    tmp_path.mkdir(exist_ok=True)
    sampling = {"group_size": GROUP, "max_new_tokens": 6}
    return HfEngine(run_config(tmp_path, (model_dir, data_dir), sampling=sampling, rollout={"backend": "hf", "hf": hf}))


def counting_calls(engine: HfEngine) -> list[int]:
    """Each ``generate`` call's batch size, recorded as the engine makes them."""
    sizes, generate = [], engine.model.generate

    def counted(*args, **kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        return generate(*args, **kwargs)

    engine.model.generate = counted
    return sizes


def assert_scored_alike(model_dir, samples: list[tuple[list[int], list[int], np.ndarray]]) -> None:
    """Each (context, tokens, logprobs) sample's logprobs are the policy's own on its tokens: the trainer's scoring
    of the whole sequence (one forward pass, teacher-forced)."""
    model = load_model(model_dir, "float32").eval()
    expected = trainer_logprobs(model, [(context, tokens) for context, tokens, _ in samples], pad_id=0)
    for (_, _, logprobs), policy in zip(samples, expected, strict=True):
        np.testing.assert_allclose(logprobs, policy, atol=TOLERANCE)


def prompts_of(engine: HfEngine, data_dir, count: int) -> list[list[int]]:
    """``count`` held-out prompts, some repeated so lengths differ by several tokens within the batch."""
    rows = load_jsonl(data_dir / "eval.jsonl")[:count]
    return [engine.tokenizer.encode(r["prompt"] * (1 + i % 3), add_special_tokens=False) for i, r in enumerate(rows)]


def test_a_batch_of_16_prompts_x_8_is_one_generate_call_with_each_samples_own_logprobs(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    engine = engine_for(model_dir, data_dir, tmp_path)
    sizes = counting_calls(engine)
    prompt_ids = prompts_of(engine, data_dir, PROMPTS)

    groups = engine.generate(prompt_ids, sampling(), 32)

    assert sizes == [PROMPTS * GROUP]
    assert [len(group) for group in groups] == [GROUP] * PROMPTS
    samples = [(ids, g) for ids, group in zip(prompt_ids, groups, strict=True) for g in group]
    for _, g in samples:
        tokens = g.token_ids.tolist()
        assert (g.finish_reason == "stop") == (tokens[-1] in engine.end_tokens)
        assert g.finish_reason == "stop" or len(tokens) == 6
        assert engine.tokenizer.eos_token_id not in tokens[:-1]  # no padding after the end kept as tokens
    assert len({len(g.token_ids) for _, g in samples}) > 1  # sequences ended apart within the call
    assert_scored_alike(model_dir, [(ids, g.token_ids.tolist(), g.logprobs) for ids, g in samples])


def test_a_cap_of_the_group_size_makes_one_call_per_group_and_samples_the_same_distribution(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    engine = engine_for(model_dir, data_dir, tmp_path, max_sequences_per_call=GROUP)
    sizes = counting_calls(engine)
    prompt_ids = prompts_of(engine, data_dir, 4)
    # Near-zero temperature: sampling is the argmax, so the per-group and the batched calls must draw alike.
    cold = sampling(temperature=1e-4)

    per_group = engine.generate(prompt_ids, cold, 32)
    engine.max_per_call = None
    batched = engine.generate(prompt_ids, cold, 32)

    assert sizes == [GROUP] * 4 + [4 * GROUP]
    for a, b in zip((g for group in per_group for g in group), (g for group in batched for g in group), strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOLERANCE)


def test_greedy_continuations_in_one_padded_batch_are_each_rows_own(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    engine = engine_for(model_dir, data_dir, tmp_path)
    contexts = prompts_of(engine, data_dir, 24)
    limits = [1 + i % 6 for i in range(len(contexts))]
    assert len({len(c) for c in contexts}) >= 3
    common = {"pad_id": engine.pad_id, "end_tokens": engine.end_tokens}

    batched = generate_batch(engine.model, contexts, limits, **common)
    alone = [generate_batch(engine.model, [c], [n], **common)[0] for c, n in zip(contexts, limits, strict=True)]

    for a, b, n in zip(alone, batched, limits, strict=True):
        assert a.token_ids == b.token_ids and a.stopped == b.stopped and len(b.token_ids) <= n
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOLERANCE)


def test_every_live_episodes_turn_is_one_call_and_each_ends_at_its_own_stop(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    engine = engine_for(model_dir, data_dir, tmp_path)
    sizes = counting_calls(engine)
    contexts = prompts_of(engine, data_dir, 32)
    limits = [4 + i % 3 for i in range(len(contexts))]
    stop = ["1", "5"]  # digits the arithmetic model writes: rows stop on them at different places, or not at all

    # Temperature and top-p reshape what is sampled from; the logprobs recorded stay the raw policy's.
    turns = engine.generate_turns(contexts, limits, sampling(temperature=0.7, top_p=0.9), stop)

    assert sizes == [len(contexts)]
    decode = engine.tokenizer.decode
    on_stop = set()
    for limit, turn in zip(limits, turns, strict=True):
        tokens = turn.token_ids.tolist()
        assert not any(s in decode(tokens[:-1]) for s in stop)  # nothing before its last token held a stop
        ended = tokens[-1] in engine.end_tokens or any(s in decode(tokens) for s in stop)
        assert (turn.finish_reason == "stop") == ended and (ended or len(tokens) == limit)
        if any(s in decode(tokens) for s in stop):
            on_stop.add(len(tokens))
    assert len(on_stop) >= 2  # rows stopped on a stop string at different lengths, in the same call
    assert_scored_alike(
        model_dir, [(c, t.token_ids.tolist(), t.logprobs) for c, t in zip(contexts, turns, strict=True)]
    )


def test_a_tokenizer_without_a_pad_token_pads_with_its_eos_and_generates_the_same(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    padless = without_pad_token(model_dir, tmp_path / "padless")
    with_pad = engine_for(model_dir, data_dir, tmp_path / "with")
    without = engine_for(padless, data_dir, tmp_path / "without")
    contexts = prompts_of(with_pad, data_dir, 12)
    limits = [6] * len(contexts)

    assert without.tokenizer.pad_token is None and without.pad_id == without.tokenizer.eos_token_id
    expected = generate_batch(with_pad.model, contexts, limits, pad_id=with_pad.pad_id, end_tokens=with_pad.end_tokens)
    got = generate_batch(without.model, contexts, limits, pad_id=without.pad_id, end_tokens=without.end_tokens)
    for a, b in zip(expected, got, strict=True):
        assert a.token_ids == b.token_ids and a.stopped == b.stopped
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOLERANCE)
    groups = without.generate(contexts[:2], sampling(), 32)
    assert [len(group) for group in groups] == [GROUP, GROUP]
