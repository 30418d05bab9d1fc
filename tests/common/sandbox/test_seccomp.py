"""The box's system-call filter as a program (services/common/sandbox/seccomp.py), run here by a small classic-BPF
interpreter over the bytes the kernel would get: what it decides for each call, ABI and argument on both
architectures. tests/common/sandbox/test_box_filter.py runs it in real boxes."""

from __future__ import annotations

import errno
import os
import struct

import pytest

from services.common.sandbox import probe, seccomp
from services.common.sandbox.seccomp import ARCHITECTURES, DENIED, RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS

pytestmark = pytest.mark.unit

EPERM, ENOSYS, ALLOW, KILL = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS, RET_ALLOW, RET_KILL_PROCESS
MACHINES = sorted(ARCHITECTURES)
AUDIT_ARCH_I386, AUDIT_ARCH_ARM = 0x40000003, 0x40000028
FOREIGN = {"x86_64": AUDIT_ARCH_I386, "aarch64": AUDIT_ARCH_ARM}
SIGCHLD = 17
# What glibc 2.36 passes to clone for fork() and for a thread (pthread_create, once clone3 says ENOSYS).
FORK_FLAGS = 0x01200000 | SIGCHLD  # CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID
THREAD_FLAGS = 0x003D0F00  # VM, FS, FILES, SIGHAND, THREAD, SYSVSEM, SETTLS, PARENT_SETTID, CHILD_CLEARTID


def decoded(machine: str) -> list[tuple[int, int, int, int]]:
    raw = seccomp.program(machine)
    return [seccomp.SOCK_FILTER.unpack_from(raw, at) for at in range(0, len(raw), seccomp.SOCK_FILTER.size)]


def decide(machine: str, nr: int, args: tuple[int, ...] = (), arch: int | None = None) -> int:
    """What the program returns for one call, run as the kernel runs it over ``struct seccomp_data``."""
    arch = ARCHITECTURES[machine].audit_arch if arch is None else arch
    data = struct.pack("<IIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    program, pc, accumulator = decoded(machine), 0, 0
    while True:
        code, jt, jf, k = program[pc]
        pc += 1
        if code == seccomp.LD_W_ABS:
            accumulator = struct.unpack_from("<I", data, k)[0]
        elif code == seccomp.RET:
            return k
        else:
            taken = {seccomp.JEQ: accumulator == k, seccomp.JGE: accumulator >= k, seccomp.JSET: accumulator & k}
            pc += jt if taken[code] else jf


def number(machine: str, name: str) -> int:
    return ARCHITECTURES[machine].numbers[name]


def denied(machine: str) -> list[str]:
    return [name for names in DENIED.values() for name in names if name in ARCHITECTURES[machine].numbers]


@pytest.mark.parametrize("machine", MACHINES)
def test_the_program_checks_the_architecture_before_it_reads_the_system_call_number(machine):
    program = decoded(machine)
    load_arch, check_arch = program[0], program[1]
    assert load_arch == (seccomp.LD_W_ABS, 0, 0, seccomp.ARCH)
    assert check_arch[0] == seccomp.JEQ and check_arch[3] == ARCHITECTURES[machine].audit_arch
    assert program[2 + check_arch[2]][0::3] == (seccomp.RET, KILL)  # jf: another architecture is killed
    # Whatever number a call of another ABI carries (one the native table denies included), it is killed.
    for nr in (0, 1, 39, number(machine, "unshare"), number(machine, "ptrace"), 0xFFFFFFFF):
        assert decide(machine, nr, arch=FOREIGN[machine]) == KILL


def test_on_x86_64_a_call_through_the_x32_abi_is_killed():
    x32 = seccomp.X32_SYSCALL_BIT
    # getpid, x32's own ptrace, and two calls the native table denies or inspects
    for nr in (39, 512 + 9, number("x86_64", "unshare"), number("x86_64", "clone")):
        assert decide("x86_64", x32 | nr) == KILL
    assert decide("x86_64", 39) == ALLOW


@pytest.mark.parametrize("machine", MACHINES)
def test_every_denied_call_jumps_to_the_eperm_return_and_nothing_else_does(machine):
    program = decoded(machine)
    numbers = ARCHITECTURES[machine].numbers
    deny_returns = {pc for pc, (code, _, _, k) in enumerate(program) if (code, k) == (seccomp.RET, EPERM)}
    jumps_to_deny = {
        k for pc, (code, jt, _, k) in enumerate(program) if code == seccomp.JEQ and pc + 1 + jt in deny_returns
    }
    # A direct jump per denied number; the inspected calls reach it only through their argument checks.
    direct = {k for k in jumps_to_deny if k in numbers.values()}
    assert direct == {numbers[name] for name in denied(machine)}
    for name in denied(machine):
        assert decide(machine, numbers[name]) == EPERM, name


@pytest.mark.parametrize("machine", MACHINES)
def test_every_call_the_policy_does_not_name_is_allowed_whatever_its_arguments(machine):
    numbers = ARCHITECTURES[machine].numbers
    named = set(numbers.values())
    for nr in range(600):
        if nr not in named:
            assert decide(machine, nr, (0xFFFFFFFF,) * 6) == ALLOW, nr
            assert decide(machine, nr) == ALLOW, nr


@pytest.mark.parametrize("machine", MACHINES)
def test_clone_with_a_namespace_flag_is_refused_and_fork_and_threads_are_not(machine):
    clone = number(machine, "clone")
    for flag in (1 << bit for bit in range(32) if seccomp.NAMESPACE_FLAGS & (1 << bit)):
        assert decide(machine, clone, (FORK_FLAGS | flag,)) == EPERM, hex(flag)
    assert decide(machine, clone, (seccomp.CLONE_NEWUSER | 1 << 32,)) == EPERM  # high bits change nothing
    assert decide(machine, clone, (FORK_FLAGS,)) == ALLOW
    assert decide(machine, clone, (THREAD_FLAGS,)) == ALLOW
    assert decide(machine, clone, (SIGCHLD,)) == ALLOW
    # clone3's flags lie behind a pointer: ENOSYS, whatever it points at, so glibc falls back to the checked clone.
    assert decide(machine, number(machine, "clone3"), (0x7FFF0000, 88)) == ENOSYS


@pytest.mark.parametrize("machine", MACHINES)
def test_personality_allows_only_linux_and_the_query(machine):
    personality = number(machine, "personality")
    assert decide(machine, personality, (seccomp.PER_LINUX,)) == ALLOW
    assert decide(machine, personality, (seccomp.PERSONALITY_QUERY,)) == ALLOW
    for persona in (0x0040000, 0x0400000, 0x0008, 0x0020000):  # ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, LINUX32...
        assert decide(machine, personality, (persona,)) == EPERM


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("call", ["socket", "socketpair"])
def test_sockets_open_only_in_unix_inet_inet6_and_netlink(machine, call):
    nr = number(machine, call)
    for family in (1, 2, 10, 16):
        assert decide(machine, nr, (family, 1, 0)) == ALLOW
    for family in (40, 17, 38, 15, 30, 0, 46):  # AF_VSOCK, AF_PACKET, AF_ALG, AF_KEY, AF_TIPC, AF_UNSPEC, AF_MAX
        assert decide(machine, nr, (family, 1, 0)) == EPERM, family


@pytest.mark.parametrize("machine", MACHINES)
def test_each_table_numbers_every_call_of_the_policy_once(machine):
    numbers = ARCHITECTURES[machine].numbers
    named = {name for names in DENIED.values() for name in names} | set(seccomp.INSPECTED)
    assert len(set(numbers.values())) == len(numbers)
    # aarch64 never had these x86 calls; every other call of the policy is in both tables.
    missing = {"aarch64": {"uselib", "ustat", "sysfs", "iopl", "ioperm", "modify_ldt"}, "x86_64": set()}[machine]
    assert set(numbers) == named - missing


def test_a_jump_past_classic_bpfs_reach_is_refused_not_wrapped():
    lines: list[seccomp.Line] = [(seccomp.JEQ, 1, "far", 0), *[(seccomp.RET, ALLOW, 0, 0)] * 256, "far"]
    lines.append((seccomp.RET, EPERM, 0, 0))
    with pytest.raises(ValueError, match="out of classic BPF's forward reach"):
        seccomp.assemble(lines)


def test_a_machine_without_a_table_gets_no_box_and_the_probe_says_why(monkeypatch):
    with pytest.raises(seccomp.Unsupported, match=r"has no table for riscv64, only for aarch64 and x86_64$"):
        seccomp.program("riscv64")
    # This machine, its table taken away: the box is refused before any process starts (the unit tier would stop
    # a fork), and the probe a rollout starts with names the reason, as it does where namespaces are refused.
    machine = os.uname().machine
    monkeypatch.setattr(seccomp, "ARCHITECTURES", {k: v for k, v in ARCHITECTURES.items() if k != machine})
    others = " and ".join(sorted(set(ARCHITECTURES) - {machine}))
    assert (
        probe() == f"cannot build the box: the box's system-call filter has no table for {machine}, only for {others}"
    )
