"""The environment protocol's built-ins: the safe arithmetic evaluator, the calculator and
Python tools, and rollout.environment's config refused at load naming the field."""

import re
import uuid
from pathlib import Path

import pytest

from services.cli.build.tasks import make_tool_arith_dataset
from services.common.config import ConfigError, load_config
from services.common.episodes.environments import (
    Calculator,
    PythonTool,
    StepResult,
    ToolError,
    Turn,
    environment_factory,
    evaluate_arithmetic,
)
from services.common.model.datasets import load_jsonl
from tests.support.runs import config_file, run_config

pytestmark = pytest.mark.unit


def turn(text: str) -> Turn:
    return Turn(text=text, token_ids=tuple(range(len(text))))


@pytest.mark.parametrize(
    ("expression", "value"),
    [("1234*5678", 7006652), ("(12+3)*4 - 6/3", 58), ("7/2", 3.5), ("-2**3", -8), ("17 // 5 + 17 % 5", 5)],
)
def test_the_evaluator_computes_arithmetic(expression, value):
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "only numbers and"),
        ("x + 1", "only numbers and"),
        ("(1).real", "only numbers and"),
        ("[1, 2]", "only numbers and"),
        ("'a' * 3", "only numbers and"),
        ("9 ** 99", "exponent 99 is above 64"),
        ("(10 ** 20) * (10 ** 20)", "result above 1e+30"),
        ("1 / 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("2 +", "not an arithmetic expression"),
        ("1+" * 101 + "1", "longer than 200 characters"),
    ],
)
def test_the_evaluator_refuses_anything_but_bounded_arithmetic(expression, reason):
    with pytest.raises(ToolError, match=re.escape(reason)):
        evaluate_arithmetic(expression)


def test_the_calculator_answers_the_turns_last_call():
    result = Calculator().step(turn("First, <calc>1+1</calc> then <calc>123*456</calc>"))
    assert result == StepResult(observation="<result>56088</result>", tool_call=True)


def test_the_calculator_answers_a_call_whose_last_token_reaches_past_the_closing_tag():
    assert Calculator().step(turn("<calc>6*7</calc>.\n")).observation == "<result>42</result>"


def test_a_malformed_calculator_call_is_a_tool_error_the_model_sees():
    result = Calculator().step(turn("<calc>12*</calc>"))
    assert (result.tool_call, result.tool_error, result.done) == (True, True, False)
    assert result.observation.startswith("<result>error: not an arithmetic expression")


def test_a_turn_without_a_call_ends_the_episode():
    assert Calculator().step(turn("The answer is 42.")) == StepResult(done=True)


@pytest.mark.integration
def test_the_python_tool_runs_code_in_a_child_and_shows_its_output():
    assert PythonTool().step(turn("<python>print(sum(range(10)))</python>")).observation == "<result>45</result>"


@pytest.mark.integration
def test_the_python_tool_stops_code_that_takes_too_much_memory():
    result = PythonTool().step(turn("<python>x = bytearray(2 << 30)</python>"))
    assert (result.tool_error, result.observation) == (True, "<result>error: MemoryError</result>")


@pytest.mark.integration
def test_the_python_tool_stops_code_that_runs_too_long_and_every_process_it_started():
    marker = "rlpipe-sleeper-" + uuid.uuid4().hex
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker[:7]!r} + {marker[7:]!r}])\n"
        "while True: pass"
    )
    result = PythonTool().step(turn(f"<python>{code}</python>"))
    assert (result.tool_error, result.observation) == (True, "<result>error: the code ran past 5s</result>")
    # The box's whole PID namespace went with it (tests/common/sandbox has the detached and setsid cases).
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline") if marker.encode() in read_or_nothing(p)]


def read_or_nothing(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended while listed
        return b""


@pytest.mark.integration
def test_the_python_tool_stops_code_that_writes_too_much_and_runs_in_a_private_tmp_of_its_own():
    result = PythonTool().step(turn("<python>print('x' * 3_000_000)</python>"))
    assert (result.tool_error, result.observation) == (
        True,
        "<result>error: OSError: [Errno 27] File too large</result>",
    )
    where = PythonTool().step(turn("<python>import os; print(os.getcwd(), os.listdir('/tmp'))</python>"))
    assert where.observation == "<result>/tmp []</result>"


def test_a_plugin_environment_is_found_by_its_import_path():
    assert environment_factory("tests.common.episodes.test_environments:Calculator") is Calculator
    assert environment_factory("python") is PythonTool


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        (
            {"environment": "abacus"},
            "rollout.environment: environment 'abacus' is not one of ['calculator', 'python', 'no-tool']",
        ),
        ({"environment": "no_such_module:Env"}, "'no_such_module:Env': module 'no_such_module' cannot be imported"),
        (
            {"environment": "calculator", "environment_url": "http://env:8000"},
            "set rollout.environment or rollout.environment_url, not both",
        ),
        ({"environment_url": "env:8000"}, "rollout.environment_url: String should match pattern"),
        (
            {"environment": "calculator", "max_tokens_per_turn": 600, "max_total_tokens": 512},
            "rollout.max_tokens_per_turn=600 must be at most rollout.max_total_tokens=512",
        ),
        ({"turn_stop": ["</calc>", ""]}, "rollout.turn_stop may not hold an empty string"),
        ({"observation_role": "tool reply"}, "rollout.observation_role: String should match pattern"),
        ({"max_turns": 0}, "rollout.max_turns: Input should be greater than or equal to 1"),
    ],
)
def test_bad_environment_config_is_refused_at_load_naming_the_field(tmp_path, config_only_model, rollout, message):
    with pytest.raises(ConfigError) as error:
        run_config(tmp_path, config_only_model, rollout=rollout)
    assert message in str(error.value)


def test_an_environment_config_loads(tmp_path, config_only_model):
    rollout = {"environment": "calculator", "turn_stop": ["</calc>"], "max_turns": 3}
    cfg = run_config(tmp_path, config_only_model, rollout=rollout)
    assert (cfg.rollout.multi_turn, cfg.rollout.turn_stop, cfg.rollout.max_turns) == (True, ["</calc>"], 3)


def test_a_multi_turn_run_whose_held_out_episodes_no_rule_could_score_is_refused_at_load(tmp_path, config_only_model):
    rollout = {"environment": "calculator", "turn_stop": ["</calc>"]}
    reward = {"functions": {"exact_match": -1.0}}  # a weight that only ever takes away
    with pytest.raises(ConfigError) as error:
        run_config(tmp_path, config_only_model, rollout=rollout, reward=reward)
    assert "reward.functions and reward.environment_weight, none of which has a positive weight" in str(error.value)
    assert "leave data.eval_path empty" in str(error.value)

    without_eval = {"train_path": str(config_only_model[1] / "train.jsonl"), "eval_path": None}
    config = config_file(tmp_path, config_only_model, "d.yaml", rollout=rollout, reward=reward, data=without_eval)
    assert load_config(config).rollout.multi_turn


def test_the_tool_arith_rows_hold_transcripts_whose_calls_the_calculator_answers_as_written(tmp_path):
    paths = make_tool_arith_dataset(tmp_path, seed=1, n_eval=5, n_dev=5, n_train=40, tool_share=1.0)
    rows = [row for split in ("train", "dev", "eval") for row in load_jsonl(paths[split])]
    assert (len(rows), len({row["prompt"] for row in rows})) == (50, 50)
    for row in rows:
        a, b = map(int, re.fullmatch(r"(\d{3})\*(\d{2})=", row["prompt"]).groups())
        assert row["answer"] == str(a * b)
        call, result, answer = re.fullmatch(r"(<calc>.*</calc>)(<result>.*</result>)(\d+)", row["transcript"]).groups()
        assert Calculator().step(turn(call)).observation == result
        assert answer == row["answer"]


def test_a_tool_share_keeps_the_problems_and_splits_and_states_the_other_answers_outright(tmp_path):
    every = make_tool_arith_dataset(tmp_path / "every", seed=1, n_eval=5, n_dev=5, n_train=400, tool_share=1.0)
    some = make_tool_arith_dataset(tmp_path / "some", seed=1, n_eval=5, n_dev=5, n_train=400, tool_share=0.25)
    for split in ("train", "dev", "eval"):
        pairs = zip(load_jsonl(every[split]), load_jsonl(some[split]), strict=True)
        for with_tool, mixed in pairs:
            assert (mixed["prompt"], mixed["answer"]) == (with_tool["prompt"], with_tool["answer"])
            assert mixed["transcript"] in (with_tool["transcript"], with_tool["answer"])
    called = [row["transcript"].startswith("<calc>") for split in ("train", "dev") for row in load_jsonl(some[split])]
    assert 0.15 < sum(called) / len(called) < 0.35  # 405 rows drawn at 0.25: about 0.02 either way
    with pytest.raises(ValueError, match=r"tool_share must be within \[0, 1\], got 1.5"):
        make_tool_arith_dataset(tmp_path / "bad", tool_share=1.5)
