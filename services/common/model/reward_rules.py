"""Rule-based reward functions, chosen by name in ``reward.functions`` with a weight each.

A function maps (completion text, reference answer, finish reason) to a float. The
group's reward for a completion is the weighted sum of the chosen functions.
Register your own with ``@reward_function("name")``, or name it in the config by its
import path ``module:function`` (see docs/rewards.md and examples/reward_plugin.py).

The reward role runs these in a child process with a time limit per call
(``services.reward.sandbox``), so none of them needs a timeout of its own: math-verify's
signal-based timeouts are switched off here because they only work in a main thread.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from math_verify import parse, verify

from services.common.model.answers import ends_on_answer, parse_number
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


@reward_function("math_verify")
def math_verified(text: str, answer: str, finish_reason: str) -> float:
    """1 if Hugging Face's math-verify finds the completion's answer equal to the reference, else 0.

    Equality is mathematical: ``\\boxed{\\frac{1}{2}}``, ``$0.5$`` and ``1/2`` all match ``"1/2"``; a
    ``\\boxed{}`` answer wins over other numbers in the text. A reference math-verify cannot read
    raises ValueError naming it (a dataset that does not fit this check, not a wrong completion).
    """
    gold = parse(answer, parsing_timeout=None)  # type: ignore[arg-type]  # None: no signal alarm (see above)
    if not gold:
        raise ValueError(f"reference answer {answer!r} is not something math-verify can read")
    predicted = parse(text, parsing_timeout=None)  # type: ignore[arg-type]
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=None))


_GSM8K_ANSWER = re.compile(r"####\s*([-+]?[\d,]*\.?\d+)")


def gsm8k_answer(text: str) -> str | None:
    """The number after the last ``#### `` marker (GSM8K's answer format), without thousands commas."""
    found = _GSM8K_ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


@reward_function("gsm8k")
def gsm8k(text: str, answer: str, finish_reason: str) -> float:
    """1 if the number after the completion's last ``#### `` equals the reference by value, else 0.

    The reference may be a bare number or a whole GSM8K solution ending in ``#### N``. A
    completion without the marker scores 0 even if it holds the right number: the format
    is part of the task. A reference that holds no number raises ValueError naming it.
    """
    expected = parse_number(gsm8k_answer(answer) or answer)
    if expected is None:
        raise ValueError(f"reference answer {answer!r} is not a number nor ends in '#### <number>'")
    found = gsm8k_answer(text)
    return float(found is not None and parse_number(found) == expected)


@reward_function("length_penalty")
def length_penalty(text: str, answer: str, finish_reason: str) -> float:
    """-1 for a completion cut off by ``sampling.max_new_tokens`` (it never finished its answer), else 0.

    Added with a positive weight to a correctness reward, it makes running out of room worse
    than a wrong but finished answer (DAPO's overlong punishment, without its soft ramp).
    """
    return -1.0 if finish_reason == "length" else 0.0


@reward_function("format_penalty")
def format_penalty(text: str, answer: str, finish_reason: str) -> float:
    """-1 for a completion that commits to no final answer (no ``#### N``, no ``\\boxed{}``, no number), else 0."""
    committed = gsm8k_answer(text) is not None or "\\boxed{" in text or final_answer(text) is not None
    return 0.0 if committed else -1.0


def score(text: str, answer: str, finish_reason: str, weights: dict[str, float]) -> float:
    return sum(weight * REWARD_FUNCTIONS[name](text, answer, finish_reason) for name, weight in weights.items())
