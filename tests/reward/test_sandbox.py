"""Rule functions run in a child process: a call that never ends is killed and scores 0, the replica goes on."""

import os

import pytest

from services.reward.sandbox import RewardFunctionError, RuleCall, RuleSandbox

pytestmark = pytest.mark.integration


def forever(text: str, answer: str, finish_reason: str) -> float:
    """A function that hangs on the completion "hang" (as math on a huge expression can)."""
    while text == "hang":
        pass
    return 1.0


def refuses(text: str, answer: str, finish_reason: str) -> float:
    raise ValueError(f"cannot judge {answer!r}")


def crashes(text: str, answer: str, finish_reason: str) -> float:
    os._exit(3)  # as a segfault in native code would end the process


HANGS = "tests.reward.test_sandbox:forever"


@pytest.fixture
def sandbox():
    box = RuleSandbox(timeout_s=5.0)  # far above a call on a loaded machine, and what a hang costs
    yield box
    box.close()


def test_a_hung_call_scores_zero_and_the_calls_after_it_are_still_scored(sandbox):
    calls = [
        RuleCall("exact_match", "12", "12", "stop"),
        RuleCall(HANGS, "hang", "1", "stop"),
        RuleCall(HANGS, "fine", "1", "stop"),
        RuleCall("exact_match", "13", "12", "stop"),
    ]
    assert sandbox.score(calls) == [1.0, 0.0, 1.0, 0.0]
    assert sandbox.timeouts == 1
    # The replacement child serves the next batch as well.
    assert sandbox.score([RuleCall("exact_match", "7", "7", "stop")]) == [1.0]


def test_a_function_that_raises_names_itself_and_leaves_the_sandbox_usable(sandbox):
    calls = [RuleCall("tests.reward.test_sandbox:refuses", "1", "x", "stop"), RuleCall("exact_match", "1", "1", "stop")]
    with pytest.raises(RewardFunctionError, match=r"test_sandbox:refuses.*cannot judge 'x'"):
        sandbox.score(calls)
    assert sandbox.score([RuleCall("exact_match", "5", "5", "stop")]) == [1.0]
    assert sandbox.timeouts == 0


def test_a_function_that_kills_its_process_fails_the_input_and_a_fresh_child_takes_over(sandbox):
    with pytest.raises(RewardFunctionError, match=r"test_sandbox:crashes' crashed its process"):
        sandbox.score([RuleCall("tests.reward.test_sandbox:crashes", "1", "1", "stop")])
    assert sandbox.score([RuleCall("exact_match", "5", "5", "stop")]) == [1.0]
