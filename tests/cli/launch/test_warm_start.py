"""The warm starter (services/cli/launch/warm_start.py): roles forked from one process that imported their modules once,
each behaving as the ``python -m`` process it replaces. Real processes, signals and pipes."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cli.launch.warm_start import WarmStarter, WarmStartError, _same_user, listening
from tests.support.paths import ROOT
from tests.support.servers import running_warm_pool

pytestmark = pytest.mark.integration

CHILD = [sys.executable, "-m", "tests.cli.launch.warm.child"]


@pytest.fixture
def starter(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the folder a child is given: the launcher's
    env = {**os.environ, "HOME_SHOULD_GO": "1"}
    starter = WarmStarter.start(["tests.cli.launch.warm.marker"], env, tmp_path / "warm-start.log")
    yield starter
    starter.process.kill()
    starter.close()


def wait_exited(pid: int, timeout: float = 10.0) -> None:
    """Until ``pid`` is gone or a zombie (dead, not yet reaped by whoever inherited it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still running")


def test_a_forked_child_runs_its_module_as_main_with_its_own_arguments_environment_folder_and_exit_code(
    starter, tmp_path
):
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "WARM_TEST": "mine"}
    process = starter.spawn([*CHILD, "report", "3"], env)
    seen = json.loads(process.stdout.readline())
    assert process.wait(timeout=30) == 3
    assert seen["argv"] == ["report", "3"] and seen["main"] == "__main__"
    assert seen["pid"] == process.pid and seen["pid"] != starter.process.pid
    # The preloaded module was imported once, by the warm starter, not again by the child.
    assert seen["imported_by"] == starter.process.pid
    # The request's environment replaces the warm starter's, and the folder is the launcher's.
    assert (seen["env"], seen["home_seen"], seen["cwd"]) == ("mine", False, str(ROOT))


def test_signals_reach_the_child_as_they_would_a_fresh_interpreter(starter):
    env = dict(os.environ)
    sleeper = starter.spawn([*CHILD, "sleep"], env)
    assert sleeper.stdout.readline() == b"sleeping\n"
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.3)
    # Ctrl-C reaches the whole process group: the warm starter ignores it, a role gets KeyboardInterrupt and, left
    # uncaught, dies of SIGINT as `python -m` does.
    os.kill(starter.process.pid, signal.SIGINT)
    sleeper.send_signal(signal.SIGINT)
    assert sleeper.wait(timeout=30) == -signal.SIGINT
    assert starter.alive
    killed = starter.spawn([*CHILD, "sleep"], env)
    assert killed.stdout.readline() == b"sleeping\n"
    killed.kill()
    assert killed.wait(timeout=30) == -signal.SIGKILL


def test_children_die_with_the_warm_starter_and_report_killed(starter):
    child = starter.spawn([*CHILD, "sleep"], dict(os.environ))
    assert child.stdout.readline() == b"sleeping\n"
    starter.process.kill()
    starter.process.wait()
    wait_exited(child.pid)
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert not starter.alive


@pytest.fixture
def pool(tmp_path, monkeypatch):
    """A warm-start pool preloading the marker module; yields (its process, its socket)."""
    monkeypatch.chdir(ROOT)  # the folder a child is given: the launcher's
    with running_warm_pool(["tests.cli.launch.warm.marker"], tmp_path / "pool.log") as started:
        yield started


def test_runs_joining_one_pool_get_sessions_of_their_own_whose_roles_use_the_pools_imports(pool):
    process, socket_path = pool
    first, second = WarmStarter.join(socket_path), WarmStarter.join(socket_path)
    assert len({first.process.pid, second.process.pid, process.pid}) == 3
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "WARM_TEST": "pooled"}
    mine, theirs = first.spawn([*CHILD, "report", "4"], env), second.spawn([*CHILD, "report", "5"], env)
    seen_mine, seen_theirs = json.loads(mine.stdout.readline()), json.loads(theirs.stdout.readline())
    # Imported once, by the pool: neither the sessions nor the roles imported the preloaded module again.
    assert seen_mine["imported_by"] == seen_theirs["imported_by"] == process.pid
    assert (seen_mine["env"], seen_mine["cwd"]) == ("pooled", str(ROOT))
    assert mine.wait(timeout=30) == 4 and theirs.wait(timeout=30) == 5
    # Each session reports the exits of its own roles only.
    assert set(first.exits) == {mine.pid} and set(second.exits) == {theirs.pid}
    first.close()
    second.close()


def test_a_session_ends_with_its_launcher_taking_its_roles_while_the_pool_serves_the_next(pool):
    process, socket_path = pool
    starter = WarmStarter.join(socket_path)
    sleeper = starter.spawn([*CHILD, "sleep"], dict(os.environ))
    assert sleeper.stdout.readline() == b"sleeping\n"
    session = starter.process.pid
    starter.channel.close()  # the launcher gone: its session ends and its roles die with it
    wait_exited(session)
    wait_exited(sleeper.pid)
    assert process.poll() is None
    again = WarmStarter.join(socket_path)
    child = again.spawn([*CHILD, "report", "0"], dict(os.environ))
    assert json.loads(child.stdout.readline())["imported_by"] == process.pid
    assert child.wait(timeout=30) == 0
    again.close()


def test_roles_die_with_the_pool_and_a_missing_pool_is_refused_naming_its_socket(pool):
    process, socket_path = pool
    starter = WarmStarter.join(socket_path)
    child = starter.spawn([*CHILD, "sleep"], dict(os.environ))
    assert child.stdout.readline() == b"sleeping\n"
    process.kill()
    process.wait()
    wait_exited(child.pid)
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert not starter.alive
    starter.close()
    with pytest.raises(WarmStartError, match=f"cannot join the warm-start pool at {socket_path}"):
        WarmStarter.join(socket_path)


def test_the_pools_socket_is_its_owners_alone_and_a_caller_of_its_own_user_is_let_in(tmp_path):
    previous = os.umask(0o002)  # a shared-group umask: bind alone would leave the socket group-writable
    try:
        server = listening(str(tmp_path / "pool.sock"))
    finally:
        os.umask(previous)
    try:
        assert (tmp_path / "pool.sock").stat().st_mode & 0o777 == 0o600
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        assert _same_user(ours)
        ours.close()
        theirs.close()
    finally:
        server.close()
