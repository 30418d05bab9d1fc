"""The reward model: the tiny one ranks right above wrong held-out answers; devices, templates, truncation, labels."""

import random

import numpy as np
import pytest
import torch

from services.cli.build.tiny_reward_model import wrong_answer
from services.common.config import ConfigError, RewardModelConfig, load_config_with
from services.common.model.datasets import load_jsonl
from services.reward.model import RewardModel, model_device
from services.reward.service import weights_of
from tests.support.padless import without_pad_token
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration


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


@pytest.mark.unit
def test_device_auto_takes_a_visible_gpu_and_cuda_without_one_stops_the_replica():
    assert model_device("auto", cuda_available=True) == torch.device("cuda")
    assert model_device("auto", cuda_available=False) == torch.device("cpu")
    assert model_device("cpu", cuda_available=True) == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"reward.model.device: 'cuda' but this replica sees no CUDA device"):
        model_device("cuda", cuda_available=False)


def test_a_pair_is_rendered_with_the_chat_template_when_the_tokenizer_has_one(tiny_reward_model):
    model_dir, _ = tiny_reward_model
    scorer = RewardModel(RewardModelConfig(path=model_dir, device="cpu"))
    assert scorer.render("12+30=", "42") == "12+30=42"  # no template: the completion follows the prompt
    scorer.tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert scorer.render("12+30=", "42") == "[user]12+30=[assistant]42"


def test_a_pair_past_max_length_loses_its_start_and_keeps_the_answer_judged(tiny_reward_model):
    model_dir, _ = tiny_reward_model
    scorer = RewardModel(RewardModelConfig(path=model_dir, device="cpu", max_length=8, normalize=False))
    # Only the last 8 tokens are read: two pairs that differ only before them score the same, and the answer
    # in them still counts.
    right_a, right_b, wrong = scorer.score(
        [("1+1=" * 20 + "12+30=", "42"), ("9+9=" * 20 + "12+30=", "42"), ("1+1=" * 20 + "12+30=", "97")]
    )
    assert right_a == pytest.approx(right_b, abs=1e-5)
    assert right_a != pytest.approx(wrong, abs=1e-3)


def test_a_two_label_classifier_scores_the_log_odds_of_right_and_more_labels_are_refused(tiny_reward_model, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir, _ = tiny_reward_model
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for labels in (2, 3):
        torch.manual_seed(0)
        classifier = AutoModelForSequenceClassification.from_pretrained(
            str(model_dir), num_labels=labels, ignore_mismatched_sizes=True
        )
        classifier.config.pad_token_id = tokenizer.pad_token_id
        classifier.save_pretrained(tmp_path / str(labels))
        tokenizer.save_pretrained(tmp_path / str(labels))
    cfg = RewardModelConfig(path=tmp_path / "2", device="cpu", normalize=False)
    pairs = [("12+30=", "42"), ("5+5=", "10")]
    classifier = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "2")).eval()
    with torch.inference_mode():
        logits = torch.cat([classifier(**tokenizer(p + c, return_tensors="pt")).logits for p, c in pairs])
    np.testing.assert_allclose(RewardModel(cfg).score(pairs), (logits[:, 1] - logits[:, 0]).numpy(), rtol=1e-4)
    with pytest.raises(ConfigError, match=r"has 3 labels; a reward model has 1 \(a score\) or 2 \(wrong, right\)"):
        RewardModel(RewardModelConfig(path=tmp_path / "3", device="cpu"))


def test_the_arith_rm_example_is_a_valid_config_scoring_with_the_model_beside_the_rules(tiny_model, tiny_reward_model):
    model_dir, data_dir = tiny_model
    reward_model, _ = tiny_reward_model
    overrides = {
        "model.path": str(model_dir),
        "reward.model.path": str(reward_model),
        "data.train_path": str(data_dir / "train.jsonl"),
        "data.eval_path": str(data_dir / "eval.jsonl"),
    }
    cfg, _ = load_config_with(ROOT / "examples" / "arith-rm.yaml", overrides)
    assert weights_of(cfg.reward) == {"exact_match": 1.0, "length_penalty": 0.5, "model": 0.25}
    assert (cfg.reward.model.device, cfg.reward.model.normalize, cfg.reward.http) == ("auto", True, None)


def test_a_reward_model_whose_tokenizer_has_no_pad_token_pads_with_its_eos_and_scores_the_same(
    tiny_reward_model, tmp_path
):
    model_dir, _ = tiny_reward_model
    padless = without_pad_token(model_dir, tmp_path / "padless")
    pairs = [("12+30=", "42"), ("1+1=" * 5, "2"), ("5+5=", "10")]  # of different lengths: the batch pads

    expected = RewardModel(RewardModelConfig(path=model_dir, device="cpu")).score(pairs)
    scorer = RewardModel(RewardModelConfig(path=padless, device="cpu"))

    assert scorer.tokenizer.pad_token_id == scorer.tokenizer.eos_token_id == scorer.model.config.pad_token_id
    np.testing.assert_allclose(scorer.score(pairs), expected, atol=1e-6)
