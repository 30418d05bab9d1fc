"""The test suite's entry: its plugins, one job each (tests/support), and its command-line options."""

import pytest

# The shared helpers' asserts (wait_for's, the pool's) report their values as a test's own do.
pytest.register_assert_rewrite("tests.support")

pytest_plugins = [
    "tests.support.tiers",
    "tests.support.scheduling",
    "tests.support.fixtures",
    "tests.support.hardware",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    # The recovery simulation (tests/trainer/test_simulation.py, docs/testing.md): replay one seed, or run more.
    group = parser.getgroup("rlpipe simulation")
    group.addoption("--sim-seed", type=int, default=None, help="run only this seed of the recovery simulation")
    group.addoption("--sim-scenarios", type=int, default=1000, help="how many seeded scenarios to run (long mode)")
