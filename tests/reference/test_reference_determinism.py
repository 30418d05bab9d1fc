"""Under train.deterministic a group's reference logprobs do not depend on which groups were pulled with it."""

import numpy as np
import pytest

from services.common.transport.messages import ScoredGroup
from services.reference.service import ReferenceScorer
from tests.support.messages import completion, scored_group
from tests.support.runs import run_config

pytestmark = pytest.mark.integration


def group(name: str, prompt: list[int], lengths: list[int], seed: int) -> ScoredGroup:
    draw = np.random.default_rng(seed)
    completions = [
        completion(draw.integers(2, 40, n).astype(np.int32), logprob=0.0, text="", finish_reason="length")
        for n in lengths
    ]
    return scored_group(name, prompt="", answer="", prompt_ids=prompt, completions=completions)


def test_a_groups_reference_logprobs_are_the_same_alone_and_among_longer_groups_only_when_deterministic(
    tiny_model, tmp_path
):
    scored = {}
    for deterministic in (True, False):
        train = {"max_seq_len": 32, "deterministic": deterministic, "synchronous": True}
        cfg = run_config(tmp_path, tiny_model, f"{deterministic}.yaml", train=train)
        scorer = ReferenceScorer(cfg)
        short = group("short", [5, 7, 9], [2, 3, 1, 4], seed=0)
        # Longer sequences pad the short group's rows further when they share its forward passes.
        others = [group(f"long{i}", [6, 8, 10, 12], [20, 25, 12, 9], seed=i + 1) for i in range(3)]
        alone = scorer([short])[0].ref_logprobs
        among = scorer([others[0], short, *others[1:]])[1].ref_logprobs
        scored[deterministic] = [np.array_equal(a, b) for a, b in zip(alone, among, strict=True)]
    assert all(scored[True])
    # Without it one pass holds the whole pulled batch, padded to its longest, and the same rows differ in their
    # last bits: the per-group passes are what makes them equal.
    assert not all(scored[False])
