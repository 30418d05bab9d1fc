"""Chat dataset rows: validation, rendering with a chat template, the word-problem set, numeric answers."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from services.cli.app import app
from services.cli.build.tasks import WORD_SYSTEM, WORD_TEMPLATES, make_word_problem_dataset
from services.cli.build.tiny_model import build_char_tokenizer
from services.common.model.answers import ends_on_answer, last_number, parse_number
from services.common.model.chat import ChatTemplateMissing, ChatTemplateRefused, prompt_text, render_rows
from services.common.model.datasets import load_jsonl, row_problem
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def line(row: object) -> bytes:
    return json.dumps(row).encode()


def test_a_messages_row_is_a_row() -> None:
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}], "answer": "2"}
    assert row_problem(line(row)) is None
    assert row_problem(line({"prompt": "1+1=", "answer": "2"})) is None


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"answer": "2"}, "missing or non-string field 'prompt' (or give 'messages')"),
        ({"prompt": "1+1=", "answer": 2}, "missing or non-string field 'answer'"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}], "answer": "2"}, "has both 'prompt' and"),
        ({"messages": [], "answer": "2"}, "field 'messages' must be a non-empty list"),
        ({"messages": "hi", "answer": "2"}, "field 'messages' must be a non-empty list"),
        ({"messages": ["hi"], "answer": "2"}, "messages[0] is not a JSON object"),
        ({"messages": [{"role": "user"}], "answer": "2"}, "messages[0].content is missing or not a string"),
        ({"messages": [{"content": "x"}], "answer": "2"}, "messages[0].role is missing or not a string"),
        ({"messages": [{"role": "bot", "content": "x"}], "answer": "2"}, "messages[0].role 'bot' is not one of"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "answer": "2"},
            "messages[1].role is 'assistant'; the last message is what the model answers",
        ),
    ],
)
def test_a_bad_row_names_the_field(row: dict, problem: str) -> None:
    found = row_problem(line(row))
    assert found is not None and found.startswith(problem)


def test_load_jsonl_names_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(
        line({"prompt": "1+1=", "answer": "2"}).decode() + "\n" + line({"messages": [], "answer": "1"}).decode()
    )
    with pytest.raises(ValueError, match=r"rows\.jsonl:2: field 'messages' must be a non-empty list"):
        load_jsonl(path)


@pytest.mark.integration
def test_rendering_uses_the_chat_template_with_a_generation_prompt() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    chat = {
        "id": "c",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "answer": "1",
    }
    plain = {"id": "p", "prompt": "1+1=", "answer": "2"}
    assert prompt_text(chat, tokenizer) == "[system] s\n[user] q\n[assistant] "
    assert prompt_text(plain, tokenizer) == "1+1="
    rendered = render_rows([chat, plain], tokenizer)
    assert [r["prompt"] for r in rendered] == ["[system] s\n[user] q\n[assistant] ", "1+1="]
    assert rendered[0]["messages"] == chat["messages"] and "prompt" not in chat  # the input rows are not changed


@pytest.mark.integration
def test_a_row_may_carry_a_worked_tool_exchange_and_a_template_that_refuses_it_names_the_row() -> None:
    messages = [
        {"role": "system", "content": "Use <calc>."},
        {"role": "user", "content": "123*45?"},
        {"role": "assistant", "content": "<calc>123*45</calc>"},
        {"role": "tool", "content": "<result>5535</result>"},
        {"role": "assistant", "content": "5535"},
        {"role": "user", "content": "964*59?"},
    ]
    row = {"id": "t", "messages": messages, "answer": "56876"}
    assert row_problem(line(row)) is None
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    assert "[tool] <result>5535</result>\n" in prompt_text(row, tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateRefused, match=r"row 't': the model's chat template cannot render its messages"):
        prompt_text(row, tokenizer)


def test_a_chat_row_without_a_template_names_the_row() -> None:
    tokenizer = build_char_tokenizer()
    assert not tokenizer.chat_template
    with pytest.raises(ChatTemplateMissing, match="row 'w1' has 'messages' but the model's tokenizer has no chat"):
        prompt_text({"id": "w1", "messages": [{"role": "user", "content": "q"}], "answer": "1"}, tokenizer)


def test_word_problems_are_valid_disjoint_reproducible_and_right(tmp_path: Path) -> None:
    paths = make_word_problem_dataset(tmp_path / "a", seed=3, n_train=300, n_eval=50, n_dev=20)
    again = make_word_problem_dataset(tmp_path / "b", seed=3, n_train=300, n_eval=50, n_dev=20)
    for split in ("train", "dev", "eval"):
        assert paths[split].read_bytes() == again[split].read_bytes()
    rows = {split: load_jsonl(path) for split, path in paths.items()}
    assert {split: len(r) for split, r in rows.items()} == {"train": 300, "dev": 20, "eval": 50}
    ids = [row["id"] for r in rows.values() for row in r]
    assert len(set(ids)) == 370
    questions = [row["messages"][1]["content"] for r in rows.values() for row in r]
    assert len(set(questions)) == 370
    for row in rows["train"]:
        assert row["messages"][0] == {"role": "system", "content": WORD_SYSTEM}
        # The id carries the template and operands: recompute the answer from them.
        _, template, _, _, a, b = row["id"].split("-")
        op = WORD_TEMPLATES[int(template)][1]
        assert row["answer"] == str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
        assert int(row["answer"]) >= 0
        assert f" {int(a)} " in row["messages"][1]["content"]


def test_build_tiny_writes_the_word_problem_variant_where_smol_arith_reads_it(tmp_path: Path, monkeypatch) -> None:
    # No --data: the default is the task's own folder (examples/smol-arith.yaml's), never the arithmetic data.
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, ["build-tiny", "--task", "word-problems"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["eval"] == "data/word-problems/eval.jsonl"
    rows = load_jsonl(tmp_path / "data" / "word-problems" / "train.jsonl")
    assert len(rows) == 4000 and all(row_problem(line(row)) is None for row in rows)
    assert not (tmp_path / "models").exists() and not (tmp_path / "data" / "arith").exists()


def test_each_build_tiny_task_writes_where_its_example_config_reads(monkeypatch) -> None:
    import services.cli.build.tiny_model as tiny_model

    built = []
    monkeypatch.setattr(tiny_model, "main", built.append)  # the arguments only: the tool build takes minutes
    for task, example in (("arithmetic", "arith-grpo.yaml"), ("tool-arith", "tool-arith.yaml")):
        assert CliRunner().invoke(app, ["build-tiny", "--task", task]).exit_code == 0
        argv = built.pop()
        config = yaml.safe_load((ROOT / "examples" / example).read_text())
        assert argv[argv.index("--out") + 1] == config["model"]["path"], task
        assert str(Path(argv[argv.index("--data") + 1]) / "train.jsonl") == config["data"]["train_path"], task
    done = CliRunner().invoke(app, ["build-tiny", "--task", "tool-arithmetic"])
    assert done.exit_code == 2 and "--task must be one of arithmetic, word-problems, tool-arith" in done.output


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("Tom now has 42 apples.", Fraction(42)),
        ("17 + 25 = 42", Fraction(42)),
        ("17-5 is 12", Fraction(12)),
        ("it is -5", Fraction(-5)),
        ("17-5", Fraction(5)),  # a minus after a digit subtracts, it is no sign
        ("about 1,234 of them", Fraction(1234)),
        ("1,2,3", Fraction(3)),
        ("costs 3.50 dollars.", Fraction(7, 2)),
        ("The answer is 42.", Fraction(42)),
        ("no numbers here", None),
    ],
)
def test_last_number(text: str, value: Fraction | None) -> None:
    assert last_number(text) == value


def test_ends_on_answer_compares_values() -> None:
    assert ends_on_answer("so 6 + 7 = 13 apples", "13")
    assert ends_on_answer("13.0", "13") and ends_on_answer("+13", " 13 ")
    assert not ends_on_answer("13 apples, then 2 more", "13")
    assert not ends_on_answer("nothing", "13")
    assert parse_number("1,000") == 1000 and parse_number("12 apples") is None
    with pytest.raises(ValueError, match="reference answer 'thirteen' is not a number"):
        ends_on_answer("13", "thirteen")


def test_held_out_accuracy_reads_a_chat_answers_final_number_and_a_plain_answer_strictly() -> None:
    from services.common.model.evaluation import answered

    chat = {"messages": [{"role": "user", "content": "Tom has 7 apples and buys 5 more. How many?"}], "answer": "12"}
    assert answered("Tom now has 7 + 5 = 12 apples.", chat)
    assert not answered("Tom has 12 apples, then eats 1 and has 11.", chat)
    plain = {"prompt": "7+5=", "answer": "12"}
    assert answered(" 12 ", plain)
    assert not answered("12 apples", plain)  # a plain row is the answer alone: held-out accuracy is not gamed
