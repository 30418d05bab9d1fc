"""Seeded sampling on the real engines, vLLM and transformers (train.deterministic): a group's completions depend on
its seeds alone, not on the prompts that shared its engine call nor on what the engine generated before."""

import pytest

from services.common.seeding import sampling_seed
from services.rollout.engines import HfEngine, VllmEngine
from tests.support.runs import run_config

pytestmark = pytest.mark.integration

PROMPTS = ["37+45=", "9+9=", "12+30=", "5+61="]


def drawn(groups) -> list[list[tuple[tuple[int, ...], tuple[float, ...]]]]:
    return [[(tuple(g.token_ids.tolist()), tuple(g.logprobs.tolist())) for g in group] for group in groups]


@pytest.mark.parametrize("engine_class", [VllmEngine, HfEngine], ids=["vllm", "hf"])
def test_a_seeded_group_draws_the_same_completions_alone_among_other_prompts_and_turns_and_an_unseeded_one_does_not(
    tiny_model, tmp_path, engine_class
):
    cfg = run_config(tmp_path, tiny_model)
    engine = engine_class(cfg)
    ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    n, length = cfg.sampling.group_size, cfg.train.max_seq_len
    seeds = [[sampling_seed(cfg.train.seed, f"e0-i{p}", i) for i in range(n)] for p in range(len(PROMPTS))]

    alone = drawn(engine.generate(ids[:1], cfg.sampling, length, seeds[:1]))[0]
    among = drawn(engine.generate(ids[::-1], cfg.sampling, length, seeds[::-1]))[-1]
    assert alone == among
    assert len(alone) == n and len(set(alone)) > 1  # each sample its own stream, not one sample n times

    # A turn of an episode: one sample continuing a context, alone or in a call with other contexts.
    turn_alone = engine.generate_turns(ids[:1], [6], cfg.sampling, [], [seeds[0][0]])
    turn_among = engine.generate_turns(ids, [6] * len(ids), cfg.sampling, [], [s[0] for s in seeds])
    assert drawn([turn_alone]) == drawn([turn_among[:1]])

    # Unseeded, the engine's one stream moves on: the same call draws other completions the second time.
    first = drawn(engine.generate(ids[:1], cfg.sampling, length))
    assert drawn(engine.generate(ids[:1], cfg.sampling, length)) != first
