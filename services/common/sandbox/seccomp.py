"""The box's system-call filter: a seccomp program (classic BPF) built from the kernel's system-call numbers.

``program(machine)`` builds it as ``struct sock_filter`` bytes; ``box.py`` hands them to ``boot.py`` in the box's
spec, and the code's process installs them last, after ``no_new_privs`` and its limits, just before the code runs
(every process the code starts inherits the filter). Nothing here installs anything: the policy is tested without a
kernel. The box's namespaces and dropped capabilities remain its walls; the filter takes away the kernel's surface
that untrusted code has no use for and that sandbox escapes have gone through. In the order the program checks:

1. The ABI. A call through another ABI (i386 by ``int 0x80`` on x86_64, 32-bit ARM on aarch64, or x32: a number
   with bit 30 set on x86_64) would be read against another table of numbers: the process is killed (SIGSYS).
2. The calls in ``DENIED`` return EPERM, so Python raises PermissionError and the code goes on.
3. ``clone`` with a namespace flag: EPERM. ``clone3`` (its flags behind a pointer, which BPF cannot read): ENOSYS,
   so glibc falls back to ``clone``, which is checked.
4. ``personality`` but for PER_LINUX and the query (0xffffffff): EPERM (no ``ADDR_NO_RANDOMIZE`` for a child).
5. ``socket`` and ``socketpair`` but for AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK: EPERM. AF_VSOCK is not
   confined by a network namespace (it reaches the hypervisor's host), and the other families are surface the
   code never needs.
6. Everything else is allowed.
"""

from __future__ import annotations

import errno
import struct
from dataclasses import dataclass

# linux/bpf_common.h: the few classic BPF instructions the program uses.
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = 32 bits of seccomp_data at k
JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K: A & k
RET = 0x06  # BPF_RET | BPF_K
# linux/seccomp.h
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
# struct seccomp_data {int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6];}, in the machine's byte order:
# both tables here are little-endian, so an argument's low 32 bits come first (all this program reads of one).
NR, ARCH, ARG0 = 0, 4, 16
SOCK_FILTER = struct.Struct("=HBBI")  # struct sock_filter {__u16 code; __u8 jt; __u8 jf; __u32 k;}

# linux/sched.h: every CLONE_NEW* that clone(2) takes (CLONE_NEWTIME shares its bit with the exit signal there).
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACE_FLAGS = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)
PER_LINUX, PERSONALITY_QUERY = 0, 0xFFFFFFFF
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
X32_SYSCALL_BIT = 0x40000000

# What the code may not call, by what each group reaches. Most need a capability the box has dropped and are listed
# so that the policy does not rest on that drop alone; the rest are open to an unprivileged process.
DENIED: dict[str, tuple[str, ...]] = {
    "namespaces": ("unshare", "setns"),
    "mounts": (
        "mount",
        "umount2",
        "pivot_root",
        "chroot",
        "move_mount",
        "open_tree",
        "open_tree_attr",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "mount_setattr",
        "statmount",
        "listmount",
    ),
    "other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp", "pidfd_getfd"),
    "kernel programs, events and rings": (
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "fanotify_init",
    ),
    "keyrings": ("add_key", "request_key", "keyctl"),
    "the kernel, the machine and its clock": (
        "kexec_load",
        "kexec_file_load",
        "init_module",
        "finit_module",
        "delete_module",
        "reboot",
        "swapon",
        "swapoff",
        "acct",
        "quotactl",
        "quotactl_fd",
        "syslog",
        "vhangup",
        "sethostname",
        "setdomainname",
        "settimeofday",
        "clock_settime",
        "iopl",
        "ioperm",
        "modify_ldt",
    ),
    "file handles (open_by_handle_at walks past a bind's root)": ("name_to_handle_at", "open_by_handle_at"),
    "NUMA memory policy": (
        "mbind",
        "get_mempolicy",
        "set_mempolicy",
        "set_mempolicy_home_node",
        "migrate_pages",
        "move_pages",
    ),
    "obsolete": ("uselib", "ustat", "sysfs", "lookup_dcookie"),
}
# Calls the program looks into instead of refusing outright.
INSPECTED = ("clone", "clone3", "personality", "socket", "socketpair")

# The numbers of the calls named above, from the kernel's tables (Linux 6.19): arch/x86/entry/syscalls/syscall_64.tbl
# ("common" and "64" rows) for x86_64; include/uapi/asm-generic/unistd.h, since Linux 6.11 scripts/syscall.tbl, for
# aarch64. A call an architecture lacks is absent from its table.
# From 424 on (Linux 5.1) every architecture numbers a new call alike.
UNIFIED = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "set_mempolicy_home_node": 450,
    "statmount": 457,
    "listmount": 458,
    "open_tree_attr": 467,
}
X86_64 = {
    "socket": 41,
    "socketpair": 53,
    "clone": 56,
    "ptrace": 101,
    "syslog": 103,
    "uselib": 134,
    "personality": 135,
    "ustat": 136,
    "sysfs": 139,
    "vhangup": 153,
    "modify_ldt": 154,
    "pivot_root": 155,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "mbind": 237,
    "set_mempolicy": 238,
    "get_mempolicy": 239,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "migrate_pages": 256,
    "unshare": 272,
    "move_pages": 279,
    "perf_event_open": 298,
    "fanotify_init": 300,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    **UNIFIED,
}
AARCH64 = {
    "lookup_dcookie": 18,
    "umount2": 39,
    "mount": 40,
    "pivot_root": 41,
    "chroot": 51,
    "vhangup": 58,
    "quotactl": 60,
    "acct": 89,
    "personality": 92,
    "unshare": 97,
    "kexec_load": 104,
    "init_module": 105,
    "delete_module": 106,
    "clock_settime": 112,
    "syslog": 116,
    "ptrace": 117,
    "reboot": 142,
    "sethostname": 161,
    "setdomainname": 162,
    "settimeofday": 170,
    "socket": 198,
    "socketpair": 199,
    "add_key": 217,
    "request_key": 218,
    "keyctl": 219,
    "clone": 220,
    "swapon": 224,
    "swapoff": 225,
    "mbind": 235,
    "get_mempolicy": 236,
    "set_mempolicy": 237,
    "migrate_pages": 238,
    "move_pages": 239,
    "perf_event_open": 241,
    "fanotify_init": 262,
    "name_to_handle_at": 264,
    "open_by_handle_at": 265,
    "setns": 268,
    "process_vm_readv": 270,
    "process_vm_writev": 271,
    "kcmp": 272,
    "finit_module": 273,
    "bpf": 280,
    "userfaultfd": 282,
    "kexec_file_load": 294,
    **UNIFIED,
}


@dataclass(frozen=True)
class Architecture:
    """What the filter needs of one architecture: its ``AUDIT_ARCH_*`` (linux/audit.h), its table of numbers, and
    the bit that marks a second ABI sharing that audit arch (x32 on x86_64), if any."""

    audit_arch: int
    numbers: dict[str, int]
    foreign_bit: int = 0


ARCHITECTURES = {
    "x86_64": Architecture(audit_arch=0xC000003E, numbers=X86_64, foreign_bit=X32_SYSCALL_BIT),
    "aarch64": Architecture(audit_arch=0xC00000B7, numbers=AARCH64),
}


class Unsupported(Exception):
    """No table of system-call numbers for this machine: no filter, so no box."""


@dataclass(frozen=True)
class Instruction:
    """One ``struct sock_filter``: ``jt`` and ``jf`` count instructions forward from the next one."""

    code: int
    jt: int
    jf: int
    k: int


# A line of the program before its jumps are resolved: a label (where the next instruction is), or an instruction
# whose jt and jf are labels or 0 (the next instruction).
Line = str | tuple[int, int, str | int, str | int]


def program(machine: str) -> bytes:
    """The filter for ``machine`` (``os.uname().machine``) as ``prctl(PR_SET_SECCOMP)`` takes it; Unsupported for a
    machine without a table."""
    return b"".join(SOCK_FILTER.pack(i.code, i.jt, i.jf, i.k) for i in instructions(machine))


def instructions(machine: str) -> list[Instruction]:
    if machine not in ARCHITECTURES:
        known = " and ".join(sorted(ARCHITECTURES))
        raise Unsupported(f"the box's system-call filter has no table for {machine}, only for {known}")
    arch = ARCHITECTURES[machine]
    nr = arch.numbers
    lines: list[Line] = [(LD_W_ABS, ARCH, 0, 0), (JEQ, arch.audit_arch, 0, "kill"), (LD_W_ABS, NR, 0, 0)]
    if arch.foreign_bit:
        lines.append((JGE, arch.foreign_bit, "kill", 0))
    lines += [(JEQ, nr[name], "deny", 0) for names in DENIED.values() for name in names if name in nr]
    lines += [
        (JEQ, nr["clone3"], "nosys", 0),
        (JEQ, nr["clone"], "clone", 0),
        (JEQ, nr["personality"], "personality", 0),
        (JEQ, nr["socket"], "family", 0),
        (JEQ, nr["socketpair"], "family", 0),
        (RET, RET_ALLOW, 0, 0),
        # The flags are an unsigned long, but clone(2) reads only their low 32 bits, where every CLONE_NEW* is.
        "clone",
        (LD_W_ABS, ARG0, 0, 0),
        (JSET, NAMESPACE_FLAGS, "deny", "allow"),
        "personality",
        (LD_W_ABS, ARG0, 0, 0),  # an unsigned int
        (JEQ, PER_LINUX, "allow", 0),
        (JEQ, PERSONALITY_QUERY, "allow", "deny"),
        "family",
        (LD_W_ABS, ARG0, 0, 0),  # an int
        *[(JEQ, family, "allow", 0) for family in SOCKET_FAMILIES[:-1]],
        (JEQ, SOCKET_FAMILIES[-1], "allow", "deny"),
        "allow",
        (RET, RET_ALLOW, 0, 0),
        "deny",
        (RET, RET_ERRNO | errno.EPERM, 0, 0),
        "nosys",
        (RET, RET_ERRNO | errno.ENOSYS, 0, 0),
        "kill",
        (RET, RET_KILL_PROCESS, 0, 0),
    ]
    return assemble(lines)


def assemble(lines: list[Line]) -> list[Instruction]:
    """Resolve the labels to forward offsets (classic BPF jumps only forward, at most 255 instructions)."""
    labels: dict[str, int] = {}
    count = 0
    for line in lines:
        if isinstance(line, str):
            labels[line] = count
        else:
            count += 1
    program: list[Instruction] = []
    for line in lines:
        if isinstance(line, str):
            continue
        code, k, jt, jf = line
        here = len(program)
        offsets = [target if isinstance(target, int) else labels[target] - here - 1 for target in (jt, jf)]
        if not all(0 <= offset <= 255 for offset in offsets):
            raise ValueError(f"instruction {here} jumps {offsets}: out of classic BPF's forward reach")
        program.append(Instruction(code, offsets[0], offsets[1], k))
    return program
