"""A whole `rlpipe run` of a model whose tokenizer names no pad token (a GGUF import leaves SmolLM2 so on some
transformers versions): the transformers rollout, the reference, the trainer's packing and its held-out evaluation
all pad with the EOS instead (services/common/model/padding.py), and the run trains and evaluates to its end."""

import math

import pytest

from services.common.model.datasets import load_jsonl
from services.common.model.evaluation import greedy_accuracy
from services.common.model.modeling import load_model, load_tokenizer
from services.common.observe import metrics as m
from tests.support.padless import without_pad_token
from tests.support.runs import run_pipeline, write_config

pytestmark = pytest.mark.e2e

EVAL_SIZE = 60


def test_a_run_of_a_model_without_a_pad_token_trains_and_evaluates_as_one_with_a_pad_token(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    padless = without_pad_token(model_dir, tmp_path / "padless")
    config = write_config(
        tmp_path / "padless.yaml",
        padless,
        data_dir,
        tmp_path / "runs",
        run_id="padless",
        train={"total_steps": 2},
        # The step-0 evaluation is where the run crashed; rows of different lengths make it pad.
        data={"eval_every_steps": 1, "eval_size": EVAL_SIZE, "eval_batch_size": 16},
        rollout={"backend": "hf", "prompts_per_batch": 8},
    )

    # Run to its end with nothing acting on it meanwhile: there is no end to race.
    done, rows = run_pipeline(config)

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [row for row in rows if row.is_step]
    assert [row.step for row in steps] == [1, 2]
    assert all(math.isfinite(row[metric]) for row in steps for metric in (m.REWARD_MEAN, m.KL_REF, m.ENTROPY))
    evals = {row.step: row[m.EVAL_ACCURACY] for row in rows if row.is_eval}
    assert sorted(evals) == [0, 1, 2]
    # Before any step the policy is the base model: its accuracy is the one the model gets with its pad token.
    eval_rows = load_jsonl(data_dir / "eval.jsonl")[:EVAL_SIZE]
    assert evals[0] == greedy_accuracy(load_model(model_dir), load_tokenizer(model_dir), eval_rows, 6, batch_size=16)
