import pytest

from services.common.model.reward_rules import REWARD_FUNCTIONS, final_answer, score

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "answer", "expected"),
    [
        ("82", "82", 1.0),
        ("082", "82", 1.0),
        ("81", "82", 0.0),
        ("", "82", 0.0),
        ("8 2", "82", 0.0),
        ("so 8+74=82", "82", 1.0),
        ("0", "0", 1.0),
    ],
)
def test_exact_match(text, answer, expected):
    assert REWARD_FUNCTIONS["exact_match"](text, answer, "stop") == expected


def test_format_needs_a_lone_integer_ended_by_eos():
    fmt = REWARD_FUNCTIONS["format"]
    assert fmt("82", "", "stop") == 1.0
    assert fmt("82", "", "length") == 0.0
    assert fmt("8x2", "", "stop") == 0.0


def test_weighted_sum_and_final_answer():
    assert score("82", "82", "stop", {"exact_match": 1.0, "format": 0.5}) == 1.5
    assert final_answer("a 12 b 34") == "34" and final_answer("none") is None
