"""Telling a deterministic crash from one a restart may get past: pure rules over crashes parsed from tracebacks."""

from __future__ import annotations

import pytest

from services.cli.launch.crash_loop import Crash, CrashLoopGuard

pytestmark = pytest.mark.unit

TRACEBACK = """Traceback (most recent call last):
  File "/app/services/common/service.py", line 221, in run_service
    asyncio.run(serve())
  File "/app/services/common/model/evaluation.py", line 61, in greedy_generate
    padded = torch.tensor(rows)
RuntimeError: Could not infer dtype of NoneType"""


def crash(error: str = "RuntimeError: boom", line: int = 61) -> Crash:
    return Crash(error, f"/app/x.py:{line} in f")


def test_a_traceback_gives_its_last_line_and_innermost_frame():
    assert Crash.of_traceback(TRACEBACK) == Crash(
        "RuntimeError: Could not infer dtype of NoneType",
        "/app/services/common/model/evaluation.py:61 in greedy_generate",
    )


@pytest.mark.parametrize("text", ["", "killed", "RuntimeError: no frames above it"])
def test_text_that_is_not_a_traceback_is_no_crash(text):
    assert Crash.of_traceback(text) is None


def test_the_same_crash_twice_without_progress_repeats_and_the_first_never_does():
    guard = CrashLoopGuard()
    assert guard.repeated("trainer", crash(), progressed=False) is None
    assert guard.repeated("trainer", crash(), progressed=False) == crash()


def test_progress_between_two_alike_crashes_is_a_new_start_of_the_count():
    guard = CrashLoopGuard()
    guard.repeated("trainer", crash(), progressed=False)
    assert guard.repeated("trainer", crash(), progressed=True) is None
    assert guard.repeated("trainer", crash(), progressed=False) == crash()


@pytest.mark.parametrize("second", [crash(error="RuntimeError: other"), crash(line=62), None])
def test_a_crash_that_moves_or_has_no_traceback_does_not_repeat(second):
    guard = CrashLoopGuard()
    guard.repeated("trainer", crash(), progressed=False)
    assert guard.repeated("trainer", second, progressed=False) is None


def test_an_exit_without_traceback_between_two_alike_crashes_breaks_the_pair():
    guard = CrashLoopGuard()
    guard.repeated("trainer", crash(), progressed=False)
    guard.repeated("trainer", None, progressed=False)  # a SIGKILL: no traceback
    assert guard.repeated("trainer", crash(), progressed=False) is None


def test_services_are_counted_apart():
    guard = CrashLoopGuard()
    guard.repeated("reward-0", crash(), progressed=False)
    assert guard.repeated("reward-1", crash(), progressed=False) is None
    assert guard.repeated("reward-0", crash(), progressed=False) == crash()
