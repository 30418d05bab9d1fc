"""The box's system-call filter in real boxes: what it refuses, shown against the same box built without it (where
the kernel lets each call through: the filter is what stops it), and the ordinary Python it leaves alone. The
decisions for every call and both architectures are tested as a program in test_seccomp.py; these run on x86_64,
where the numbers and the machine code below are x86_64's."""

from __future__ import annotations

import errno
import json
import signal

import pytest

from services.common.episodes.environments import ToolError, run_python
from services.common.sandbox import Box, Outcome

pytestmark = pytest.mark.integration

FILTERED = pytest.mark.parametrize("filtered", [True, False], ids=["filtered", "unfiltered"])


def run(code: str, filtered: bool) -> Outcome:
    return Box(syscall_filter=filtered).run(code)


def printed(outcome: Outcome):
    assert outcome.exit_status == 0, outcome
    return json.loads(outcome.stdout)


# syscall(2) by number, as [result, errno]; the arguments are C longs or buffers.
SYSCALL = """
import ctypes, json, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)


def call(nr, *args):
    result = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    return [result, ctypes.get_errno() if result == -1 else 0]
"""

# A user namespace three ways: unshare(2), clone(2) with CLONE_NEWUSER (the child leaves at once), and unshare in a
# child interpreter the code starts (the filter is inherited).
NAMESPACES = (
    SYSCALL
    + """
import subprocess
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
cloned = call(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
if cloned[0] == 0:
    os._exit(0)
if cloned[0] > 0:
    os.waitpid(cloned[0], 0)
    cloned = [1, 0]
child = "import ctypes; libc = ctypes.CDLL(None, use_errno=True); print(libc.unshare(0x10000000), ctypes.get_errno())"
in_child = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.split()
print(json.dumps({"clone": cloned, "child": [int(word) for word in in_child], "unshare": call(272, CLONE_NEWUSER)}))
"""
)


@FILTERED
def test_code_in_the_box_its_children_included_cannot_make_a_user_namespace(filtered):
    made = printed(run(NAMESPACES, filtered))
    if filtered:
        assert made == {"clone": [-1, errno.EPERM], "child": [-1, errno.EPERM], "unshare": [-1, errno.EPERM]}
    else:  # the same box without its filter: the kernel lets an unprivileged process nest a user namespace
        assert made == {"clone": [1, 0], "child": [0, 0], "unshare": [0, 0]}


# Calls an unprivileged process makes freely in a box without the filter (the kernel answers each without EPERM):
# tracing, another process's memory, io_uring, keyrings, userfaultfd, a persona without ASLR, a hypervisor socket.
SURFACE = (
    SYSCALL
    + """
import socket
params = ctypes.create_string_buffer(120)
source, target = ctypes.create_string_buffer(b"x" * 8), ctypes.create_string_buffer(8)
local = ctypes.create_string_buffer(struct.pack("PN", ctypes.addressof(target), 8))
remote = ctypes.create_string_buffer(struct.pack("PN", ctypes.addressof(source), 8))
handle = ctypes.create_string_buffer(struct.pack("II", 0, 0) + bytes(128))
tried = {
    "ptrace(PTRACE_TRACEME)": call(101, 0, 0, 0, 0),
    "io_uring_setup": call(425, 1, params),
    "process_vm_readv": call(310, os.getpid(), local, 1, remote, 1, 0),
    "kcmp": call(312, os.getpid(), os.getpid(), 0, 0, 0),
    "keyctl": call(250, 0, -3, 0),
    "add_key": call(248, b"user", b"key", b"value", 5, -3),
    "userfaultfd(UFFD_USER_MODE_ONLY)": call(323, 1),
    "personality(ADDR_NO_RANDOMIZE)": call(135, 0x0040000),
    "name_to_handle_at": call(303, -100, b"/tmp", handle, ctypes.create_string_buffer(4), 0),
}
try:
    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    tried["socket(AF_VSOCK)"] = [0, 0]
except OSError as error:
    tried["socket(AF_VSOCK)"] = [-1, error.errno]
print(json.dumps(tried))
"""
)


@FILTERED
def test_tracing_io_uring_keyrings_and_a_hypervisor_socket_are_refused_with_eperm(filtered):
    tried = printed(run(SURFACE, filtered))
    if filtered:
        assert tried == {name: [-1, errno.EPERM] for name in tried} and len(tried) == 10
    else:  # the kernel's own answers: a result, or an error of its own (AF_VSOCK where there is no hypervisor)
        assert [name for name, (_, error) in tried.items() if error == errno.EPERM] == []
        assert tried["ptrace(PTRACE_TRACEME)"] == [0, 0] and tried["io_uring_setup"][0] >= 0


# x32: getpid with bit 30 set. i386: getpid (20) by int 0x80 from a page of machine code. Unfiltered, the kernel
# answers each: x32's getpid is ENOSYS where x32 is off (as on most kernels) or the pid, and int 0x80 gives the pid
# (the code's process is the second of its PID namespace, after init).
UNFILTERED = {"x32": ("[-1, 38]", "[2, 0]"), "i386": ("2",)}
OTHER_ABIS = {
    "x32": SYSCALL + "print(json.dumps(call(0x40000000 | 39)))\n",
    "i386": """
import ctypes, mmap
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20; int 0x80; ret
getpid = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
print(getpid())
""",
}


@FILTERED
@pytest.mark.parametrize("abi", sorted(OTHER_ABIS))
def test_a_call_through_another_abi_kills_the_code(filtered, abi):
    outcome = run(OTHER_ABIS[abi], filtered)
    if filtered:
        assert (outcome.signal, outcome.stdout) == (signal.SIGSYS, "")
    else:
        assert outcome.exit_status == 0 and outcome.stdout.strip() in UNFILTERED[abi]


def test_the_tool_tells_the_model_its_code_made_a_forbidden_call_not_that_it_ran_out_of_time_or_memory():
    with pytest.raises(ToolError, match=r"killed \(SIGSYS\): it made a system call the box forbids"):
        run_python(OTHER_ABIS["x32"], Box())


# What a model's code does: imports, threads, processes (fork, a child interpreter, posix_spawn), files in /tmp,
# sockets on loopback (TCP over IPv4 and IPv6, UDP, a Unix pair, asyncio), netlink (the interface list), timers.
ORDINARY = """
import asyncio, concurrent.futures, decimal, hashlib, json, os, socket, subprocess, sys, tempfile, threading, time

seen = {"decimal": str(decimal.Decimal(1) / decimal.Decimal(7))[:8], "sha": hashlib.sha256(os.urandom(8)).digest_size}
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    seen["threads"] = sorted(pool.map(lambda n: n * n, range(4)))
pid = os.fork()
if pid == 0:
    os._exit(7)
seen["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
seen["child"] = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip()
spawned = os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], {})
seen["posix_spawn"] = os.waitstatus_to_exitcode(os.waitpid(spawned, 0)[1])
with tempfile.NamedTemporaryFile("w+", dir="/tmp") as file:
    file.write("kept")
    file.flush()
    seen["tmp"] = open(file.name).read()


def echo(family, host):
    with socket.create_server((host, 0), family=family) as server:
        with socket.create_connection(server.getsockname()[:2], timeout=5) as client:
            peer, _ = server.accept()
            client.sendall(b"ping")
            answer = peer.recv(4)
            peer.close()
            return answer.decode()


seen["tcp"], seen["tcp6"] = echo(socket.AF_INET, "127.0.0.1"), echo(socket.AF_INET6, "::1")
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as a, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as b:
    b.bind(("127.0.0.1", 0))
    a.sendto(b"udp", b.getsockname())
    seen["udp"] = b.recv(3).decode()
left, right = socket.socketpair()
left.sendall(b"unix")
seen["unix"] = right.recv(4).decode()


async def served():
    server = await asyncio.start_server(lambda r, w: (w.write(b"async"), w.close()), "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname())
    data = await reader.read()
    writer.close()
    server.close()
    return data.decode()


seen["asyncio"] = asyncio.run(served())
seen["interfaces"] = [name for _, name in socket.if_nameindex()]
started = time.monotonic()
threading.Event().wait(0.01)
seen["slept"] = time.monotonic() - started >= 0.01
print(json.dumps(seen))
"""


@FILTERED
def test_ordinary_python_runs_the_same_in_the_filtered_box(filtered):
    seen = printed(run(ORDINARY, filtered))
    assert seen == {
        "decimal": "0.142857",
        "sha": 32,
        "threads": [0, 1, 4, 9],
        "fork": 7,
        "child": "42",
        "posix_spawn": 0,
        "tmp": "kept",
        "tcp": "ping",
        "tcp6": "ping",
        "udp": "udp",
        "unix": "unix",
        "asyncio": "async",
        "interfaces": ["lo"],
        "slept": True,
    }
