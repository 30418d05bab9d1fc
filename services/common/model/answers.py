"""Reading the number a free-text answer ends on, and comparing it to a reference numerically.

A chat model answers a word problem in a sentence ("Tom now has 42 apples."), so neither the
whole text nor its first number is the answer: the last number is what it commits to. Numbers
compare by value, so ``42``, ``42.0`` and ``+42`` all match the reference ``"42"``, and
``1,234`` reads as one thousand two hundred thirty-four. Both the ``final_number`` reward
(services/common/model/reward_rules.py) and the held-out evaluation use these, so they cannot disagree.
"""

from __future__ import annotations

import re
from fractions import Fraction

# A sign counts only where it cannot be a subtraction: "17-5" is 17 minus 5, "is -5" is minus five.
# Thousands separators only in groups of three, so "1,2,3" stays three numbers.
_NUMBER = re.compile(r"(?:(?<![\w.])[-+])?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def parse_number(text: str) -> Fraction | None:
    """The exact value of a number written the way ``_NUMBER`` reads it, or None if ``text`` is not one."""
    text = text.strip()
    if _NUMBER.fullmatch(text) is None:
        return None
    return Fraction(text.replace(",", ""))


def last_number(text: str) -> Fraction | None:
    """The value of the last number in ``text``, or None when it has none."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def ends_on_answer(text: str, answer: str) -> bool:
    """True when the last number in ``text`` equals ``answer`` by value.

    Raises:
        ValueError: if ``answer`` is not a number, naming it (a dataset that does not fit this check).
    """
    expected = parse_number(answer)
    if expected is None:
        raise ValueError(f"reference answer {answer!r} is not a number")
    return last_number(text) == expected
