"""The reference scores completions exactly as the sampler's policy did when both hold the same weights."""

import numpy as np
import pytest

from services.common.config import load_config
from services.common.transport.messages import Completion, Prompt, RolloutGroup, ScoredGroup, advance
from services.reference.service import ReferenceScorer
from services.rollout.engines import HfEngine
from tests.conftest import write_config

pytestmark = pytest.mark.integration


def test_reference_logprobs_equal_sampling_logprobs_of_the_same_model(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    cfg = load_config(
        write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", rollout={"backend": "hf"})
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
        rollout = advance(
            Prompt(group_id=text, prompt_id=text, prompt=text),
            RolloutGroup,
            prompt_ids=np.asarray(ids, dtype=np.int32),
            policy_version=0,
            completions=[Completion(**vars(g)) for g in group],
        )
        groups.append(advance(rollout, ScoredGroup, rewards=np.zeros(len(group), dtype=np.float32)))

    experience = ReferenceScorer(cfg)(groups)
    for group in experience:
        assert group.kind == "experience"
        for completion, ref in zip(group.completions, group.ref_logprobs, strict=False):
            np.testing.assert_allclose(ref, completion.logprobs, atol=1e-4)
