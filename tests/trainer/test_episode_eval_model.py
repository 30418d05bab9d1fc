"""The held-out episode evaluation on the project's tiny model: the greedy batch gives each row the turn it gives
the row alone, and a run whose model never calls its tool scores exactly as the single-turn evaluation does."""

import pytest

from services.common.config import load_config
from services.common.model.datasets import load_jsonl
from services.common.model.evaluation import greedy_accuracy, greedy_generate
from services.common.model.modeling import load_model, load_tokenizer
from services.trainer.episode_eval import evaluate_episodes, greedy_turns
from tests.support.padless import without_pad_token
from tests.support.runs import config_file

pytestmark = pytest.mark.integration

EVAL_ROWS = 40


@pytest.fixture(scope="module")
def model_and_rows(tiny_model):
    model_dir, data_dir = tiny_model
    return load_model(model_dir, "float32"), load_tokenizer(model_dir), load_jsonl(data_dir / "eval.jsonl")[:EVAL_ROWS]


def test_a_rows_greedy_turn_in_a_left_padded_batch_is_its_turn_alone(model_and_rows):
    model, tokenizer, rows = model_and_rows
    # Contexts of different lengths (so the batch pads) and limits of their own (so rows stop apart).
    contexts = [tokenizer.encode(row["prompt"] * (1 + i % 3), add_special_tokens=False) for i, row in enumerate(rows)]
    limits = [2 + i % 5 for i in range(len(rows))]
    stop = ["+"]

    batched = greedy_turns(model, tokenizer, contexts, limits, stop)
    alone = [greedy_turns(model, tokenizer, [c], [n], stop)[0] for c, n in zip(contexts, limits, strict=True)]

    assert [g.token_ids.tolist() for g in batched] == [g.token_ids.tolist() for g in alone]
    assert [g.finish_reason for g in batched] == [g.finish_reason for g in alone]
    assert all(len(g.token_ids) <= n for g, n in zip(batched, limits, strict=True))


def test_a_model_that_never_calls_the_tool_scores_as_the_single_turn_evaluation(model_and_rows, tiny_model, tmp_path):
    model, tokenizer, rows = model_and_rows
    config = config_file(
        tmp_path,
        tiny_model,
        "run.yaml",
        rollout={"environment": "calculator", "turn_stop": ["</calc>"], "max_turns": 3, "max_tokens_per_turn": 6},
        reward={"functions": {"final_number": 1.0}},
    )

    result = evaluate_episodes(model, tokenizer, rows, load_config(config))

    # The arithmetic model answers "46" and its end-of-sequence token: one turn, no call, the number judged.
    assert (result.turns_mean, result.tool_calls_mean, result.tool_errors_mean) == (1.0, 0.0, 0.0)
    assert result.accuracy == greedy_accuracy(model, tokenizer, rows, 6)
    assert result.accuracy > 0.0  # the warm-started model gets some right: the equality above is not 0 == 0


def test_the_held_out_evaluation_generates_in_chunks_of_eval_batch_size_with_the_same_answers(model_and_rows):
    model, tokenizer, rows = model_and_rows
    sizes, generate = [], model.generate

    def counted(*args, **kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        return generate(*args, **kwargs)

    model.generate = counted
    try:
        prompts = [row["prompt"] for row in rows]
        chunked = greedy_generate(model, tokenizer, prompts, 6, batch_size=16)
        assert sizes == [16, 16, 8]
        assert chunked == greedy_generate(model, tokenizer, prompts, 6, batch_size=EVAL_ROWS)
    finally:
        del model.generate


def test_a_tokenizer_without_a_pad_token_evaluates_as_with_one(model_and_rows, tiny_model, tmp_path):
    model, tokenizer, rows = model_and_rows
    padless = load_tokenizer(without_pad_token(tiny_model[0], tmp_path / "padless"))
    contexts = [tokenizer.encode(row["prompt"] * (1 + i % 3), add_special_tokens=False) for i, row in enumerate(rows)]
    limits = [2 + i % 5 for i in range(len(rows))]

    assert padless.pad_token is None
    assert greedy_accuracy(model, padless, rows, 6) == greedy_accuracy(model, tokenizer, rows, 6)
    turns = [greedy_turns(model, tok, contexts, limits, ["+"]) for tok in (tokenizer, padless)]
    assert [g.token_ids.tolist() for g in turns[0]] == [g.token_ids.tolist() for g in turns[1]]
