"""The tiny reward model tells right from wrong held-out answers, through the reward role's own scorer."""

import random

import numpy as np

from services.common.config import RewardModelConfig
from services.common.datasets import load_jsonl
from services.reward.model import RewardModel
from services.reward.tiny_rm import wrong_answer


def test_the_reward_model_scores_right_answers_above_wrong_ones_on_held_out_prompts(tiny_model, tiny_reward_model):
    _, data_dir = tiny_model
    model_dir, summary = tiny_reward_model
    rows = load_jsonl(data_dir / "eval.jsonl")[:200]
    rng = random.Random(5)
    scorer = RewardModel(RewardModelConfig(path=model_dir, batch_size=64, device="cpu"))
    right = scorer.score([(row["prompt"], row["answer"]) for row in rows])
    wrong = scorer.score([(row["prompt"], wrong_answer(row["answer"], rng, near_miss=False)) for row in rows])
    assert right.shape == wrong.shape == (200,) and right.dtype == np.float32
    assert ((right > 0) & (right < 1)).all()  # normalized: a probability of being right
    assert (right > wrong).mean() >= 0.8
    assert right.mean() > wrong.mean() + 0.2
    assert summary["eval_ranking_accuracy"] >= 0.8


def test_raw_logits_without_normalize_and_a_batch_split_in_passes(tiny_reward_model):
    model_dir, _ = tiny_reward_model
    pairs = [("12+30=", "42"), ("12+30=", "97"), ("5+5=", "10")]
    normalized = RewardModel(RewardModelConfig(path=model_dir, batch_size=2, device="cpu")).score(pairs)
    raw = RewardModel(RewardModelConfig(path=model_dir, batch_size=3, device="cpu", normalize=False)).score(pairs)
    np.testing.assert_allclose(normalized, 1 / (1 + np.exp(-raw)), rtol=1e-4)
