"""The box for model-written code (services/common/sandbox), run against the snippets a review ran against the old
tool: each one is refused or contained, and the calling process (the rollout, here pytest) keeps its secrets,
files, processes and listeners. Where the box is what stops a snippet, the same snippet run unboxed shows that it
would have worked: the check can see the escape it rules out."""

from __future__ import annotations

import errno
import json
import os
import site
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import pytest

from services.common.sandbox import Box, BoxFailed, BoxLimits, Outcome
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration

LIMITS = BoxLimits()
SECRET = "planted-" + uuid.uuid4().hex


def run(code: str, isolated: bool = True) -> Outcome:
    return Box(LIMITS, isolated=isolated).run(code)


def printed(outcome: Outcome) -> dict:
    assert outcome.exit_status == 0, outcome
    return json.loads(outcome.stdout)


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker`` (none of the box's own processes: the code builds it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # ended while listed
                pass
    return found


# Reads every /proc/<pid>/environ it can, up the parent chain and across the pids it can see: the review's way to
# the rollout's tokens.
READ_ENVIRONMENTS = f"""
import json, os
leaked, ancestors = [], []
pid = os.getpid()
while pid > 1:
    ancestors.append(pid)
    try:
        pid = int(next(l.split()[1] for l in open(f"/proc/{{pid}}/status") if l.startswith("PPid:")))
    except OSError:
        break
for pid in ancestors + [p for p in range(1, 4096)]:
    try:
        if {SECRET!r} in open(f"/proc/{{pid}}/environ", errors="replace").read():
            leaked.append(pid)
    except OSError:
        pass
print(json.dumps({{"environment": dict(os.environ), "leaked": leaked, "proc": os.path.exists("/proc")}}))
"""


def run_in_a_caller_holding_secrets(code: str, isolated: bool) -> dict:
    """What ``code`` prints when run by a process started, as the launcher starts a rollout, with tokens in its
    environment (/proc/<pid>/environ shows a process's environment as it was exec'd, not later setenv calls)."""
    caller = f"from services.common.sandbox import Box; print(Box(isolated={isolated}).run({code!r}).stdout)"
    secrets = dict.fromkeys(("RLPIPE_S3_SECRET_KEY", "RLPIPE_WEIGHTSYNC_TOKEN", "RLPIPE_ADMIN_TOKEN"), SECRET)
    done = subprocess.run(
        [sys.executable, "-c", caller], env={**os.environ, **secrets}, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_the_box_shows_the_code_no_environment_and_no_process_of_the_caller():
    seen = run_in_a_caller_holding_secrets(READ_ENVIRONMENTS, isolated=True)
    # Empty but for the locale the interpreter sets itself; no /proc at all, so no other process's environ.
    assert set(seen["environment"]) <= {"LC_CTYPE"} and (seen["leaked"], seen["proc"]) == ([], False)


def test_without_the_box_the_code_reads_the_callers_environment_through_proc():
    seen = run_in_a_caller_holding_secrets(READ_ENVIRONMENTS, isolated=False)
    # Its own environment is empty, but its grandparent is the caller, and /proc hands over the caller's.
    assert set(seen["environment"]) <= {"LC_CTYPE"} and len(seen["leaked"]) >= 1


def test_the_box_shows_none_of_the_run_directory_the_checkout_or_the_virtual_environment(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    (run_dir / "nats-auth").mkdir(parents=True)
    secrets = [run_dir / "nats-auth" / "operator.nk", run_dir / "nats-auth" / "rollout.nk", run_dir / "admin.token"]
    for path in secrets:
        path.write_text(SECRET)
    checkout = [ROOT / "services" / "__init__.py", ROOT / "pyproject.toml"]
    venv = [Path(path) for path in site.getsitepackages()]
    code = f"""
import json, os
seen = {{}}
for path in {[str(p) for p in secrets + checkout + venv + [tmp_path, ROOT]]!r}:
    try:
        seen[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
    except OSError as error:
        seen[path] = error.errno
print(json.dumps({{"seen": seen, "root": sorted(os.listdir("/"))}}))
"""
    seen = printed(run(code))
    assert SECRET not in json.dumps(seen)
    # Every one of them is missing: the root holds the system's folders, the interpreter's install (a pyenv under
    # /root here) and its /tmp, nothing else.
    assert set(seen["seen"].values()) == {errno.ENOENT}, seen["seen"]
    assert set(seen["root"]) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "sbin", "tmp", "usr", "root"}


def test_code_in_the_box_writes_only_to_its_private_tmp_and_nothing_reaches_the_host(tmp_path):
    marker = "rlpipe-box-" + uuid.uuid4().hex
    # The review's eight 1 MiB files outside the folder, the root, the system, the interpreter's own folders (every
    # sys.path entry), its install's site-packages (there, read-only) and the caller's virtual environment's (not
    # there): a .pth file in either would run in every later process.
    targets = [str(tmp_path / f"escape-{i}") for i in range(8)]
    targets += [f"/{marker}", f"/usr/{marker}", f"/etc/{marker}", f"/dev/{marker}"]
    site_packages = [*site.getsitepackages(), sysconfig.get_path("purelib", vars={"base": sys.base_prefix})]
    targets += [os.path.join(path, f"{marker}.pth") for path in site_packages]
    code = f"""
import json, os, sys
targets = {targets!r} + [os.path.join(path or ".", "{marker}.pth") for path in sys.path]
refused = {{}}
for path in targets:
    try:
        with open(path, "wb") as file:
            file.write(b"x" * (1 << 20))
        refused[path] = 0
    except OSError as error:
        refused[path] = error.errno
with open("/tmp/{marker}", "wb") as file:
    file.write(b"x" * 1000)
print(json.dumps({{"refused": refused, "tmp": os.listdir("/tmp"), "cwd": os.getcwd()}}))
"""
    seen = printed(run(code))
    assert 0 not in seen["refused"].values(), seen["refused"]
    assert set(seen["refused"].values()) <= {errno.EROFS, errno.ENOENT, errno.EACCES}
    assert (seen["tmp"], seen["cwd"]) == ([marker], "/tmp")
    host = [Path(path) for path in targets] + [Path("/tmp", marker)]
    host += [Path(path, f"{marker}.pth") for path in sys.path if path] + [Path(site.getusersitepackages(), marker)]
    assert not [path for path in host if path.exists()]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("filtered", [True, False], ids=["filtered", "unfiltered"])
def test_code_in_the_box_cannot_make_its_read_only_binds_writable_even_in_namespaces_of_its_own(filtered):
    code = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
MS_REMOUNT, MS_BIND, MNT_DETACH = 32, 4096, 2
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x20000


def attempts():
    remounted = libc.mount(None, b"/usr", None, MS_REMOUNT | MS_BIND, None)  # clears read-only: asks for writable
    tried = [[remounted, ctypes.get_errno() if remounted else 0]]
    unmounted = libc.umount2(b"/usr", MNT_DETACH)  # would show what lies under it
    return tried + [[unmounted, ctypes.get_errno() if unmounted else 0]]


direct = attempts()  # no capability left in the box's namespaces
nested = libc.unshare(CLONE_NEWUSER | CLONE_NEWNS)  # every capability, in a copy whose mounts the kernel has locked
print(json.dumps([direct, nested, attempts()]))
"""
    direct, nested, inside = printed(Box(LIMITS, syscall_filter=filtered).run(code))
    assert direct == [[-1, errno.EPERM], [-1, errno.EPERM]]
    if filtered:  # the system-call filter refuses the namespace, and the mount calls in any namespace
        assert nested == -1 and inside == [[-1, errno.EPERM], [-1, errno.EPERM]]
    else:  # without it, the box's own lock holds: the namespace's copies of the mounts are locked by the kernel
        assert nested == 0 and inside == [[-1, errno.EPERM], [-1, errno.EINVAL]]


# A grandchild in a session of its own, double-forked away from the code's process group: it tells the code it is
# up (so the call cannot end before it exists), then sleeps with the marker in its command line.
DETACH = """
import os, sys
marker = "rlpipe-" + {tail!r}
r, w = os.pipe()
os.set_inheritable(w, True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        sleeper = "import os, time; os.write(%d, b'up'); time.sleep(120)" % w
        os.execv(sys.executable, [sys.executable, "-c", sleeper, marker])
    os._exit(0)
os.close(w)
print(os.read(r, 2).decode(), flush=True)
"""


def detached(forever: bool = False) -> tuple[str, str]:
    """The detaching code and its grandchild's marker, which the code builds (so its own argv does not hold it)."""
    tail = "escape-" + uuid.uuid4().hex
    return DETACH.format(tail=tail) + ("while True: pass\n" if forever else ""), "rlpipe-" + tail


def test_a_double_fork_and_setsid_in_the_box_does_not_outlive_the_call():
    code, marker = detached()
    outcome = run(code)
    assert (outcome.exit_status, outcome.stdout.strip()) == (0, "up")
    # The box's init ended when the code did, and its end waits for every process of its namespace: none is left.
    assert processes_with(marker) == []


def test_the_box_killed_at_its_time_limit_takes_every_process_in_it_along():
    code, marker = detached(forever=True)
    outcome = run(code)
    assert outcome.timed_out and outcome.stdout.strip() == "up"
    assert processes_with(marker) == []


def test_a_caller_killed_outright_takes_its_box_along(tmp_path):
    code, marker = detached(forever=True)
    caller = subprocess.Popen(
        [sys.executable, "-c", f"from services.common.sandbox import Box; Box().run({code!r})"],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not processes_with(marker) and time.monotonic() < deadline:  # the box is up once its sleeper is
            time.sleep(0.05)
        assert processes_with(marker), "the box's sleeper never started"
    finally:
        caller.kill()  # SIGKILL: no cleanup of its own runs
        caller.wait()
    # Each process of the box dies with its parent; the last, init, takes the namespace along.
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


def test_without_the_box_a_double_fork_and_setsid_outlives_the_call():
    code, marker = detached()
    outcome = run(code, isolated=False)
    survivors = processes_with(marker)
    try:
        assert outcome.stdout.strip() == "up" and len(survivors) == 1
    finally:
        for pid in survivors:
            os.kill(pid, 9)


@pytest.mark.parametrize("isolated", [True, False])
def test_the_box_reaches_its_own_loopback_and_no_listener_of_the_host(isolated):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"""
import json, socket
reached = {{}}
for address in [("127.0.0.1", {port}), ("10.255.255.1", 80)]:
    try:
        socket.create_connection(address, timeout=2).close()
        reached[str(address)] = 0
    except OSError as error:
        reached[str(address)] = error.errno
own = socket.create_server(("127.0.0.1", 0))
socket.create_connection(own.getsockname(), timeout=2).close()
print(json.dumps(reached))
"""
        reached = printed(run(code, isolated))
        listener.settimeout(0)
        try:
            listener.accept()[0].close()
            accepted = True
        except BlockingIOError:
            accepted = False
    host = reached[str(("127.0.0.1", port))]
    if isolated:
        assert (host, accepted) == (errno.ECONNREFUSED, False)
        assert reached[str(("10.255.255.1", 80))] == errno.ENETUNREACH  # no route out at all
    else:  # the same code unboxed reaches the host's listener: the box is what stops it
        assert (host, accepted) == (0, True)


def test_a_fork_bomb_in_the_box_stops_at_its_process_limit_and_not_the_callers():
    code = """
import json, os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        children += 1
except OSError as error:
    print(json.dumps([children, error.errno]))
"""
    children, error = printed(run(code))
    # The limit counts the box's user's processes: the builder, init and the code's own are three of them.
    assert (children, error) == (LIMITS.processes - 3, errno.EAGAIN)
    assert subprocess.run(["true"]).returncode == 0  # the caller's user still starts processes


def test_memory_in_the_box_is_bound_per_process_its_children_included():
    code = """
import json, subprocess, sys
try:
    bytearray(2 << 30)
    own = "allocated"
except MemoryError:
    own = "MemoryError"
child = subprocess.run([sys.executable, "-c", "bytearray(2 << 30)"], capture_output=True, text=True)
print(json.dumps([own, child.stderr.strip().splitlines()[-1]]))
"""
    assert printed(run(code)) == ["MemoryError", "MemoryError"]


def test_a_box_that_cannot_be_built_fails_as_the_boxs_fault_naming_the_step_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    unbuildable = Box(BoxLimits(tmp_bytes=-1))  # the kernel refuses a tmpfs of that size: /tmp cannot be mounted
    with pytest.raises(BoxFailed, match=r"^cannot build the box: mount /tmp: Invalid argument$"):
        unbuildable.run(f"open({str(marker)!r}, 'w')")
    assert not marker.exists()


def test_code_cannot_pass_its_own_failure_off_as_the_boxs():
    # What the box says goes to a file the code never holds: a setup line on the code's stderr is just its output.
    outcome = run("import sys; print('setup cannot build', file=sys.stderr); sys.exit(1)")
    assert (outcome.exit_status, outcome.stderr.strip()) == (1, "setup cannot build")


def test_the_code_cannot_pass_its_own_failure_off_as_the_boxs_by_signalling_the_boxs_init():
    # Signals from inside a PID namespace reach its init only where init handles them: it handles none, so these
    # are dropped, the code goes on, and what ends the call is the code's own outcome, never a box that "failed".
    code = (
        "import os, signal\n"
        "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT):\n"
        "    os.kill(1, sig)\n"
        "print('still here')\n"
    )
    outcome = Box().run(code)
    assert (outcome.exit_status, outcome.signal, outcome.stdout.strip()) == (0, None, "still here")
    # And the code's own Ctrl-C still behaves as in any interpreter.
    interrupted = Box().run(
        "import os, signal\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
    )
    assert interrupted.stdout.strip() == "interrupted"


def test_files_in_the_boxs_tmp_are_bounded_in_number_as_in_bytes():
    code = (
        "import os\n"
        "made = 0\n"
        "try:\n"
        "    while made < 100000:\n"
        "        open(f'/tmp/{made}', 'w').close()\n"
        "        made += 1\n"
        "except OSError as error:\n"
        "    print(made, error.errno)\n"
    )
    made, error = Box().run(code).stdout.split()
    assert int(made) < 5000 and int(error) == errno.ENOSPC  # 16 MiB of /tmp: 4096 inodes, not memory's worth
