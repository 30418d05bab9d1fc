import pytest

from services.common.model.reward_rules import REWARD_FUNCTIONS, gsm8k_answer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "answer", "expected"),
    [
        ("so the answer is \\boxed{42}", "42", 1.0),
        ("$\\frac{1}{2}$", "0.5", 1.0),
        ("The result is \\boxed{\\frac{2}{4}}", "1/2", 1.0),
        ("I think 41, no: \\boxed{43}", "42", 0.0),
        ("no idea", "42", 0.0),
        ("", "42", 0.0),
    ],
)
def test_math_verify_judges_mathematical_equality(text, answer, expected):
    assert REWARD_FUNCTIONS["math_verify"](text, answer, "stop") == expected


def test_math_verify_refuses_a_reference_it_cannot_read():
    with pytest.raises(ValueError, match="math-verify can read"):
        REWARD_FUNCTIONS["math_verify"]("\\boxed{1}", "", "stop")


@pytest.mark.parametrize(
    ("text", "answer", "expected"),
    [
        ("Tom has 3 + 4 = 7 apples.\n#### 7", "7", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### 7.0", "7", 1.0),
        ("#### 8", "She had 3+4=7.\n#### 7", 0.0),
        ("steps... #### 6 wait #### 7", "Natalia sold 48/2 = 24 clips.\n#### 7", 1.0),
        ("The answer is 7", "7", 0.0),
    ],
)
def test_gsm8k_reads_the_number_after_the_last_marker(text, answer, expected):
    assert REWARD_FUNCTIONS["gsm8k"](text, answer, "stop") == expected


def test_gsm8k_answer_and_a_reference_without_a_number():
    assert gsm8k_answer("a\n#### -12") == "-12" and gsm8k_answer("none") is None
    with pytest.raises(ValueError, match="not a number"):
        REWARD_FUNCTIONS["gsm8k"]("#### 1", "many", "stop")


def test_length_penalty_punishes_only_a_cut_off_completion():
    assert REWARD_FUNCTIONS["length_penalty"]("1234567", "1", "length") == -1.0
    assert REWARD_FUNCTIONS["length_penalty"]("1234567", "1", "stop") == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("#### 5", 0.0), ("\\boxed{x}", 0.0), ("it is 5", 0.0), ("I do not know", -1.0), ("", -1.0)],
)
def test_format_penalty_punishes_a_completion_committing_to_no_answer(text, expected):
    assert REWARD_FUNCTIONS["format_penalty"](text, "5", "stop") == expected
