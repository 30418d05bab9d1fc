"""The final_number reward: the last number of a chat answer against the reference, by value."""

from __future__ import annotations

import pytest

from services.common import registry
from services.common.config import RewardConfig
from services.common.model.reward_rules import final_number, score

pytestmark = pytest.mark.unit


def test_final_number_is_registered_and_built_in() -> None:
    assert registry.REWARD_FUNCTIONS["final_number"] is final_number
    assert "final_number" in registry.REWARD_FUNCTIONS.builtin
    assert RewardConfig(functions={"final_number": 1.0}).functions == {"final_number": 1.0}


@pytest.mark.parametrize(
    ("text", "finish_reason", "reward"),
    [
        ("Tom has 17 + 25 = 42 apples.", "stop", 1.0),
        ("Tom now has 42.", "length", 1.0),
        ("42 - 17 = 25", "stop", 0.0),
        ("To solve this problem, we need to", "length", 0.0),
        ("forty-two", "stop", 0.0),
    ],
)
def test_final_number_scores(text: str, finish_reason: str, reward: float) -> None:
    assert final_number(text, "42", finish_reason) == reward


def test_weighted_with_format_in_score() -> None:
    assert score("so 42", "42", "stop", {"final_number": 0.5, "format": 1.0}) == 0.5
    assert score("42", "42", "stop", {"final_number": 0.5, "format": 1.0}) == 1.5


def test_a_non_numeric_reference_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="reference answer 'forty-two' is not a number"):
        final_number("42", "forty-two", "stop")
