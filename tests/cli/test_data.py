"""`rlpipe data sample`: random rows of a run's dataset, as the model will see them."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from services.cli.app import app
from services.common.model.modeling import load_tokenizer
from tests.support.runs import config_file

pytestmark = pytest.mark.integration


def sample(*args: str):
    return CliRunner().invoke(app, ["data", "sample", *args])


def test_sampled_rows_are_the_seeds_draw_rendered_and_counted_as_the_rollout_encodes_them(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    config = config_file(tmp_path, tiny_model)
    rows = [json.loads(line) for line in (data_dir / "train.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(model_dir)

    done = sample(str(config), "--rows", "3", "--seed", "7")
    assert done.exit_code == 0, done.output
    chosen = sorted(random.Random(7).sample(range(len(rows)), 3))
    assert done.output.splitlines()[0] == (
        f"3 of {len(rows)} rows of {data_dir / 'train.jsonl'} (split train), as the model sees them:"
    )
    for index in chosen:
        row = rows[index]
        tokens = len(tokenizer.encode(row["prompt"], add_special_tokens=False))
        header = f"--- row {index} (id {row.get('id', index)}), {tokens} prompt tokens, answer {row['answer']!r}"
        at = done.output.splitlines().index(header)
        assert done.output.splitlines()[at + 1] == row["prompt"]
    assert done.output.count("--- row ") == 3
    assert sample(str(config), "--rows", "3", "--seed", "7").output == done.output  # the same seed, the same rows
    assert sample(str(config), "--rows", "3", "--seed", "8").output != done.output


def test_eval_rows_are_sampled_from_eval_path_and_bad_requests_are_refused_in_one_line(tiny_model, tmp_path):
    _, data_dir = tiny_model
    config = config_file(tmp_path, tiny_model)
    done = sample(str(config), "-n", "2", "--split", "eval")
    assert done.exit_code == 0, done.output
    assert f"of {data_dir / 'eval.jsonl'} (split test)" in done.output.splitlines()[0]
    assert done.output.count("--- row ") == 2

    refused = sample(str(config), "--split", "dev")
    assert refused.exit_code == 2
    assert "--split must be train or eval, not 'dev'" in refused.output
    refused = sample(str(config), "--rows", "0")
    assert refused.exit_code == 2 and "--rows must be at least 1, not 0" in refused.output
    no_eval = config_file(tmp_path, tiny_model, "d.yaml", data={"eval_path": None})
    refused = sample(str(no_eval), "--split", "eval")
    assert refused.exit_code == 2 and "data.eval_path is not set" in refused.output


def test_a_chat_row_for_a_model_without_a_chat_template_is_refused_naming_the_row(tiny_model, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"id": "c1", "messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n")
    config = config_file(tmp_path, tiny_model, data={"train_path": str(chat)})
    refused = sample(str(config))
    assert refused.exit_code == 2
    assert "row 'c1' has 'messages' but the model's tokenizer has no chat template" in refused.output
