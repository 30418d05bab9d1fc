"""Rule-based reward functions, chosen by name in ``reward.functions`` with a weight each.

A function maps (completion text, reference answer, finish reason) to a float. The
group's reward for a completion is the weighted sum of the chosen functions.
Register your own with ``@reward_function("name")``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from services.common.answers import ends_on_answer
from services.common.registry import REWARD_FUNCTIONS

RewardFn = Callable[[str, str, str], float]
# The table lives in common, where config validates names against it without importing this role.
reward_function = REWARD_FUNCTIONS.register


_FINAL_NUMBER = re.compile(r"-?\d+")


def final_answer(text: str) -> str | None:
    """The last integer in ``text``: the answer an arithmetic completion commits to."""
    numbers = _FINAL_NUMBER.findall(text)
    return numbers[-1] if numbers else None


@reward_function("exact_match")
def exact_match(text: str, answer: str, finish_reason: str) -> float:
    """1 if the completion's final integer equals the reference answer, else 0."""
    found = final_answer(text)
    return float(found is not None and found.lstrip("0") == answer.strip().lstrip("0"))


@reward_function("format")
def answer_format(text: str, answer: str, finish_reason: str) -> float:
    """1 if the completion is exactly one integer that ended with EOS (not cut off by the length limit)."""
    return float(finish_reason == "stop" and re.fullmatch(r"\s*-?\d+\s*", text) is not None)


@reward_function("final_number")
def final_number(text: str, answer: str, finish_reason: str) -> float:
    """1 if the last number in a free-text (chat) answer equals the reference by value, else 0.

    "Tom now has 42 apples." and "17 + 25 = 42" both score 1 against "42"; "42 - 17 = 25" scores 0.
    A completion cut off by the length limit is judged the same way, as the held-out evaluation
    judges it. A reference answer that is not a number raises ValueError naming it.
    """
    return float(ends_on_answer(text, answer))


def score(text: str, answer: str, finish_reason: str, weights: dict[str, float]) -> float:
    return sum(weight * REWARD_FUNCTIONS[name](text, answer, finish_reason) for name, weight in weights.items())
