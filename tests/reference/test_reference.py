"""The reference scores completions exactly as the sampler's policy did when both hold the same weights."""

import numpy as np
import pytest

from services.common.model.modeling import load_tokenizer
from services.reference.service import ReferenceScorer
from services.rollout.engines import HfEngine
from tests.support.messages import completion, scored_group
from tests.support.padless import without_pad_token
from tests.support.runs import run_config

pytestmark = pytest.mark.integration


# None: one pass over the batch; 32 (max_seq_len): length-sorted passes of a few sequences each.
@pytest.mark.parametrize("micro_batch_tokens", [None, 32])
def test_reference_logprobs_equal_sampling_logprobs_of_the_same_model(tiny_model, tmp_path, micro_batch_tokens):
    cfg = run_config(
        tmp_path,
        tiny_model,
        rollout={"backend": "hf"},
        train={"max_seq_len": 32},
        reference={"micro_batch_tokens": micro_batch_tokens},
    )
    engine = HfEngine(cfg)
    prompts = ["37+45=", "9+9="]
    prompt_ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    generated = engine.generate(prompt_ids, cfg.sampling, cfg.train.max_seq_len)

    assert [len(group) for group in generated] == [cfg.sampling.group_size] * 2
    groups = []
    for text, ids, group in zip(prompts, prompt_ids, generated, strict=False):
        for g in group:
            assert g.finish_reason in ("stop", "length") and len(g.token_ids) == len(g.logprobs) > 0
            assert (g.finish_reason == "stop") == (g.token_ids[-1] == engine.tokenizer.eos_token_id)
        completions = [g.completion() for g in group]
        groups.append(scored_group(text, completions=completions, prompt_ids=ids, prompt=text, answer=""))

    scorer = ReferenceScorer(cfg)
    pairs = [(g.prompt_ids.tolist(), c.token_ids.tolist()) for g in groups for c in g.completions]
    passes = scorer.passes(pairs)
    assert sorted(i for rows in passes for i in rows) == list(range(len(pairs)))
    if micro_batch_tokens is None:
        assert len(passes) == 1
    else:
        longest = [max(len(pairs[i][0]) + len(pairs[i][1]) for i in rows) for rows in passes]
        assert len(passes) > 1 and longest == sorted(longest, reverse=True)
        assert all(len(rows) * most <= micro_batch_tokens for rows, most in zip(passes, longest, strict=True))
    experience = scorer(groups)
    for group in experience:
        assert group.kind == "experience"
        for sampled, ref in zip(group.completions, group.ref_logprobs, strict=False):
            np.testing.assert_allclose(ref, sampled.logprobs, atol=1e-4)


def test_a_reference_whose_tokenizer_has_no_pad_token_packs_with_its_eos_and_scores_the_same(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    padless = without_pad_token(model_dir, tmp_path / "padless")
    scorers = [
        ReferenceScorer(run_config(tmp_path, (folder, data_dir), f"{name}.yaml"))
        for name, folder in (("with", model_dir), ("without", padless))
    ]
    # Responses of different lengths: the pass pads the shorter ones.
    completions = [completion(ids, logprob=0.0, text="") for ids in ([7, 1], [4, 5, 6, 1], [3])]
    group = scored_group(prompt_id="p", prompt="37+45=", prompt_ids=[5, 9, 3, 6, 8, 2], completions=completions)

    assert scorers[1].pad_id == load_tokenizer(padless).eos_token_id
    expected, got = (scorer([group])[0].ref_logprobs for scorer in scorers)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6)
