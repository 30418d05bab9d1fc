"""rollout.python_tool_isolation: the Python tool refuses to start where no box can be built, unless the config
allows running model-written code unboxed, and then says so. The probe is a parameter: these tests hand in one that
fails, as a machine without user namespaces would, instead of breaking the real path."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common.config import ConfigError, RolloutConfig
from services.common.episodes.environments import PythonTool, Turn, python_tool
from services.common.episodes.episode_environment import environment_maker
from services.common.refusal import StartRefused
from services.common.startup_checks.machine import check_python_box
from services.common.startup_checks.roles import _startup_checks
from tests.support.runs import run_config

pytestmark = pytest.mark.unit

NO_NAMESPACES = "cannot build the box: unshare(user, mount, pid, net, ipc, uts): Operation not permitted"


def no_box() -> str:
    return NO_NAMESPACES


def a_box() -> None:
    return None


def test_the_python_tool_refuses_to_start_where_no_box_can_be_built_saying_why_and_what_to_set():
    with pytest.raises(StartRefused) as refused:
        python_tool("required", probe_box=no_box)
    assert NO_NAMESPACES in str(refused.value)
    assert "rollout.python_tool_isolation: allow_unisolated" in str(refused.value)


def test_allowed_unisolated_the_python_tool_runs_unboxed_only_where_no_box_can_be_built_and_says_so(caplog):
    caplog.set_level(logging.WARNING)
    unboxed = python_tool("allow_unisolated", probe_box=no_box)()
    assert isinstance(unboxed, PythonTool) and not unboxed.box.isolated
    warnings = [record for record in caplog.records if record.getMessage() == "python_tool_unisolated"]
    assert len(warnings) == 1 and warnings[0].fields == {"reason": NO_NAMESPACES}
    caplog.clear()
    assert python_tool("allow_unisolated", probe_box=a_box)().box.isolated  # a box where one can be built
    assert python_tool("required", probe_box=a_box)().box.isolated
    assert not [record for record in caplog.records if record.getMessage() == "python_tool_unisolated"]


def test_the_python_tool_is_boxed_by_default():
    assert PythonTool().box.isolated


@pytest.mark.parametrize(
    ("isolation", "probe_box", "status", "detail"),
    [
        ("required", no_box, "fail", f"no box for model-written code can be built here: {NO_NAMESPACES}"),
        ("allow_unisolated", no_box, "warn", "model-written code runs unboxed, as rollout.python_tool_isolation"),
        ("required", a_box, "ok", "new user, PID, network and mount namespaces"),
    ],
)
def test_the_start_up_check_fails_or_warns_where_no_box_can_be_built(isolation, probe_box, status, detail):
    rollout = RolloutConfig(environment="python", python_tool_isolation=isolation)
    [row] = check_python_box(rollout, probe_box=probe_box)
    assert (row.name, row.status) == ("python tool box", status) and detail in row.detail


@pytest.mark.parametrize("role", ["rollout", "trainer", "run"])
def test_the_roles_that_run_the_python_tool_check_for_its_box_at_start(role):
    # The rollout plays episodes; the trainer plays its held-out ones; rlpipe run checks before starting either.
    assert "python tool box" in [check.name for check in _startup_checks(role)]


def test_the_start_up_check_says_nothing_for_another_environment():
    assert check_python_box(RolloutConfig(environment="calculator"), probe_box=no_box) == []


@pytest.mark.integration
def test_allowed_unisolated_the_tool_runs_the_code_in_a_plain_child_process():
    unboxed = python_tool("allow_unisolated", probe_box=no_box)()
    result = unboxed.step(Turn("<python>import os; print(os.path.exists('/proc/1'), os.getcwd())</python>", (1,)))
    assert result.observation.startswith("<result>True /") and "/rlpipe-box-" in result.observation


@pytest.mark.integration
def test_a_run_with_the_python_environment_finds_a_box_here_and_plays_its_episodes_in_one(tmp_path, config_only_model):
    rollout = {"environment": "python", "turn_stop": ["</python>"]}
    cfg = run_config(tmp_path, config_only_model, rollout=rollout)
    assert [row.status for row in check_python_box(cfg.rollout)] == ["ok"]  # the real probe
    environment = environment_maker(cfg.rollout)()
    turn = Turn("<python>import os; print(os.getcwd(), os.path.exists('/proc'))</python>", (1,))
    assert asyncio.run(environment.step(turn)).observation == "<result>/tmp False</result>"


def test_a_prod_config_that_lets_model_code_run_unboxed_is_refused_naming_the_field(tmp_path, config_only_model):
    unboxed = {"python_tool_isolation": "allow_unisolated"}
    with pytest.raises(ConfigError, match=r"rollout.python_tool_isolation: allow_unisolated is refused in a prod"):
        run_config(tmp_path, config_only_model, environment="prod", rollout=unboxed)
    assert run_config(tmp_path, config_only_model, environment="dev", rollout=unboxed).environment == "dev"
