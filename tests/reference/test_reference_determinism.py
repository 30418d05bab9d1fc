"""Under train.deterministic a group's reference logprobs do not depend on which groups were pulled with it."""

import numpy as np
import pytest

from services.common.config import load_config
from services.common.transport.messages import Completion, Prompt, RolloutGroup, ScoredGroup, advance
from services.reference.service import ReferenceScorer
from tests.support.runs import write_config

pytestmark = pytest.mark.integration


def group(name: str, prompt: list[int], lengths: list[int], seed: int) -> ScoredGroup:
    draw = np.random.default_rng(seed)
    completions = [
        Completion(
            text="",
            token_ids=draw.integers(2, 40, n).astype(np.int32),
            logprobs=np.zeros(n, np.float32),
            finish_reason="length",
        )
        for n in lengths
    ]
    rollout = advance(
        Prompt(group_id=name, prompt_id=name, prompt=""),
        RolloutGroup,
        prompt_ids=np.asarray(prompt, np.int32),
        policy_version=0,
        completions=completions,
    )
    return advance(rollout, ScoredGroup, rewards=np.zeros(len(lengths), np.float32))


def test_a_groups_reference_logprobs_are_the_same_alone_and_among_longer_groups_only_when_deterministic(
    tiny_model, tmp_path
):
    model_dir, data_dir = tiny_model
    scored = {}
    for deterministic in (True, False):
        cfg = load_config(
            write_config(
                tmp_path / f"{deterministic}.yaml",
                model_dir,
                data_dir,
                tmp_path / "runs",
                train={"max_seq_len": 32, "deterministic": deterministic, "synchronous": True},
            )
        )
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
