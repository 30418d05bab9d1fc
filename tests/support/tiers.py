"""The three tiers (pyproject.toml describes them), policed: every test carries exactly one tier marker, a run asked
for some tiers gets only tests of those, and a ``unit`` test stays in pytest's process (no socket, no child process,
no model build)."""

from __future__ import annotations

import _posixsubprocess
import os
import socket
import subprocess

import pytest

# Every test belongs to exactly one tier. A module's `pytestmark` sets the tier of its tests; a test that differs
# carries its own marker, and the marker closest to the test wins.
TIERS = ("unit", "integration", "e2e")
MODEL_BUILDS = {"tiny_model", "tiny_reward_model"}  # session fixtures that train a model: never in the unit tier


def tier_of(item: pytest.Item) -> str | None:
    return next((marker.name for marker in item.iter_markers() if marker.name in TIERS), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = [item.nodeid for item in items if tier_of(item) is None]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker ({', '.join(TIERS)}): {', '.join(untiered[:10])}")
    # Caught here, before a session fixture would build the model (tens of seconds on a fresh clone) for them.
    building = [item.nodeid for item in items if tier_of(item) == "unit" and MODEL_BUILDS & set(item.fixturenames)]
    if building:
        raise pytest.UsageError(
            f"unit tests that build a model ({', '.join(sorted(MODEL_BUILDS))}): {', '.join(building[:10])}; "
            "mark them integration, or give them a folder the config loader accepts (config_only_model)"
        )
    # `-m unit` selects by any marker on the way up; keep only the tests whose own tier was asked for (one tier, or
    # several joined by "or").
    asked = {name.strip() for name in config.getoption("markexpr").split(" or ")}
    if asked <= set(TIERS):
        config.hook.pytest_deselected(items=[item for item in items if tier_of(item) not in asked])
        items[:] = [item for item in items if tier_of(item) in asked]


class UnitTierViolation(RuntimeError):
    """A test marked `unit` reached for a socket or a process: it belongs to the integration tier."""


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit tier's promise, enforced: no network connection, no listening socket, no child process."""
    if tier_of(request.node) != "unit":
        return

    def refuse(what: str):
        def refused(*args, **kwargs):
            raise UnitTierViolation(f"{request.node.nodeid} is marked unit but {what}; mark it integration")

        return refused

    monkeypatch.setattr(socket.socket, "connect", refuse("opened a network connection"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("opened a network connection"))
    monkeypatch.setattr(socket.socket, "listen", refuse("listened on a socket"))
    # subprocess and multiprocessing both start children through fork_exec (subprocess under a name of its own).
    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse("started a process"))
    monkeypatch.setattr(subprocess, "_fork_exec", refuse("started a process"))  # subprocess's own name for it
    monkeypatch.setattr(os, "fork", refuse("forked a process"))
    monkeypatch.setattr(os, "posix_spawn", refuse("started a process"))
