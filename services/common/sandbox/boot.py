"""The box's own program: ``box.py`` runs it as ``python -I -S -c <this file> SPEC CODE``, standard library only,
since the project's files are not visible where it ends up; it imports little, since every call pays for it.

Four processes, each waiting on the next (the caller kills the starter's process group at its time limit):

- the starter, the caller's child in a session of its own: forks the builder, writes the id maps of the builder's
  new user namespace (the builder cannot: an unprivileged process may map only itself, and a root caller's box is
  ``nobody`` outside, not root), then waits for it;
- the builder: unshares user, mount, PID, network, IPC and UTS namespaces, builds the root (a tmpfs holding
  read-only binds of the interpreter and the system's libraries, and a few device nodes), pivots into it and forks
- init, PID 1 of the new PID namespace: mounts the code's private ``/tmp``, brings loopback up, drops every
  capability, forks the worker and reaps until it ends; its exit makes the kernel kill every process left in the
  namespace, however it was started (a double fork and ``setsid`` included);
- the worker: sets the limits, installs the system-call filter (the spec's ``syscall_filter``, a seccomp program
  ``seccomp.py`` built on the caller's side) and runs the code, in this same interpreter.

What happened goes to the status file (its descriptor is the spec's ``status_fd``), which the worker closes before
it runs anything of the code's: ``setup <reason>``, ``exit <status>`` or ``signal <number>`` (and ``init <pid>``,
init's pid outside), so the code can neither forge its own end nor pass a failure of its own off as the box's.
``SPEC`` is ``box.BoxSpec``, marshalled (the same interpreter on both ends, and no import to read it); without
``isolate`` the starter forks the worker itself (the unisolated run a config may allow).
"""

from __future__ import annotations

import _socket
import ctypes
import fcntl
import marshal
import os
import resource
import signal
import struct
import sys

STATUS_FD = 3  # the status file's descriptor: the spec's ``status_fd``, set at start
NOBODY = 65534  # the box's user and group, inside and (for a root caller) outside

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
MNT_DETACH = 2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SOCK_FILTER_BYTES = 8  # struct sock_filter
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
# Syscalls without a libc wrapper. mount_setattr (Linux 5.12) has one number on every architecture.
SYS_MOUNT_SETATTR = 442
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

libc = ctypes.CDLL(None, use_errno=True)


class SetupFailed(Exception):
    """The box could not be built; the text says which step and why."""


class MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def call(result: int, what: str) -> None:
    if result == -1:
        raise SetupFailed(f"{what}: {os.strerror(ctypes.get_errno())}")


def syscall(number: int, *args: object) -> int:
    """``syscall(2)``, its integer arguments passed as C longs (a variadic call would pass ints)."""
    return libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))


def report(line: str) -> None:
    os.write(STATUS_FD, (line.replace("\n", " ")[:500] + "\n").encode(errors="replace"))


def die_with_parent(parent: int) -> None:
    """SIGKILL when the parent dies; a parent already gone (re-parented before the ask) ends this process now.
    ``parent`` 0: the parent lives outside this PID namespace, where its pid cannot be read."""
    call(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if parent and os.getppid() != parent:
        os._exit(1)


def write_file(path: str, text: str) -> None:
    descriptor = os.open(path, os.O_WRONLY)
    try:
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)


# The starter -----------------------------------------------------------------------------------------------------


def start(spec: dict, code: str) -> None:
    die_with_parent(spec["parent"])
    if not spec["isolate"]:
        supervise(spec, code)
    outer_uid, outer_gid = (NOBODY, NOBODY) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    builder = os.fork()
    if builder == 0:
        os.close(unshared_r)
        os.close(mapped_w)
        guarded(build, spec, code, unshared_w, mapped_r)
    os.close(unshared_w)
    os.close(mapped_r)
    if os.read(unshared_r, 1) == b"u":  # else the builder failed to unshare, and said why
        try:
            if os.geteuid() != 0:  # an unprivileged map of a group needs setgroups(2) off first
                write_file(f"/proc/{builder}/setgroups", "deny")
            write_file(f"/proc/{builder}/uid_map", f"{NOBODY} {outer_uid} 1")
            write_file(f"/proc/{builder}/gid_map", f"{NOBODY} {outer_gid} 1")
            os.write(mapped_w, b"m")
        except OSError as error:
            report(f"setup cannot map the box's user: {error}")
    os.close(mapped_w)  # unmapped, the builder reads nothing and ends
    os.waitpid(builder, 0)
    os._exit(0)


# The builder -----------------------------------------------------------------------------------------------------


def build(spec: dict, code: str, unshared_w: int, mapped_r: int) -> None:
    starter = os.getppid()
    die_with_parent(starter)
    if os.geteuid() == 0:
        os.setgroups([])
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    call(libc.unshare(flags), "unshare(user, mount, pid, net, ipc, uts)")
    os.write(unshared_w, b"u")
    os.close(unshared_w)
    if os.read(mapped_r, 1) != b"m":
        os._exit(1)  # the starter said why
    os.close(mapped_r)
    call(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    # Opened before the user changes: a root caller's interpreter may sit in a folder only root can enter, and
    # a bind from the descriptor needs no search permission on the folders above it.
    present = [path for path in spec["binds"] + spec["devices"] if os.path.lexists(path)]
    links = {path: os.readlink(path) for path in present if os.path.islink(path)}
    sources = {path: os.open(path, os.O_PATH) for path in present if path not in links}
    root, options = spec["root"], f"mode=0755,uid={NOBODY},gid={NOBODY}"
    call(libc.mount(b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()), "mount the root tmpfs")
    os.chdir(root)
    os.setresgid(NOBODY, NOBODY, NOBODY)  # the box's own user from here on (a no-op unless the caller is root)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    die_with_parent(starter)  # a change of user clears the parent-death signal
    for path, target in links.items():  # /lib64 -> usr/lib64: the link as it is
        os.makedirs(os.path.dirname(path.lstrip("/")) or ".", exist_ok=True)
        os.symlink(target, path.lstrip("/"))
    for path, source in sources.items():
        bind(path, source, writable=path in spec["devices"])
    os.mkdir("tmp")
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise SetupFailed(f"no pivot_root syscall number for {machine}")
    call(syscall(SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")
    call(libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    set_mount_attributes("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, recursive=False)
    os.closerange(3, STATUS_FD)  # nothing open of the world outside (a descriptor of a folder leads out of it)
    os.closerange(STATUS_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    init = os.fork()
    if init == 0:
        guarded(initialize, spec, code)
    report(f"init {init}")  # its pid out here: a caller that kills the box at its time limit waits for it
    os.waitpid(init, 0)  # returns once every process of the namespace is gone
    os._exit(0)


def bind(path: str, source: int, writable: bool) -> None:
    """``path`` in the new root (the working folder): a bind of the open ``source``, read-only with its submounts
    unless ``writable`` (the device nodes)."""
    inside = path.lstrip("/")
    if os.path.isdir(f"/proc/self/fd/{source}"):
        os.makedirs(inside, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(inside) or ".", exist_ok=True)
        os.close(os.open(inside, os.O_WRONLY | os.O_CREAT, 0o644))
    call(libc.mount(f"/proc/self/fd/{source}".encode(), inside.encode(), None, MS_BIND | MS_REC, None), f"bind {path}")
    os.close(source)
    attributes = MOUNT_ATTR_NOSUID if writable else MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
    set_mount_attributes(inside, attributes, recursive=True)


def set_mount_attributes(path: str, attributes: int, recursive: bool) -> None:
    attr = MountAttr(attributes, 0, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    result = syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr))
    call(result, f"mount_setattr {path or '/'}")


# Init ------------------------------------------------------------------------------------------------------------


def initialize(spec: dict, code: str) -> None:
    die_with_parent(0)
    # Inodes bounded too: empty files cost kernel memory the size bound does not count.
    tmp_bytes = spec["limits"]["tmp_bytes"]
    inodes = max(tmp_bytes // 4096, 64)
    tmp_options = f"size={tmp_bytes},nr_inodes={inodes},mode=0700,uid={NOBODY},gid={NOBODY}".encode()
    call(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, tmp_options), "mount /tmp")
    loopback_up()
    call(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")  # the worker may not trace init
    drop_capabilities()
    # The kernel gives the init of a PID namespace only the signals it handles, from inside: handling none (Python
    # handles SIGINT), it cannot be interrupted by the code, which could otherwise end the box as if it had failed.
    for number in signal.valid_signals():
        if callable(signal.getsignal(number)):
            signal.signal(number, signal.SIG_DFL)
    supervise(spec, code)


def loopback_up() -> None:
    """The new network namespace's only interface is ``lo``, down: up, the code may talk to itself, nothing else."""
    sock = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)  # _socket: the module without socket's imports
    try:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
    finally:
        sock.close()


def drop_capabilities() -> None:
    """No capability in the box's user namespace from here on, none to gain by exec: the code can change no mount
    (a read-only bind stays read-only) and configure nothing of its namespaces."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if cap == 0:
        call(-1, "prctl(PR_CAPBSET_DROP)")
    call(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT)")
    data = (CapData * 2)()
    call(libc.capset(ctypes.byref(CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), data), "capset")
    call(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    kept = (CapData * 2)()
    call(libc.capget(ctypes.byref(CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), kept), "capget")
    if any(part.effective or part.permitted or part.inheritable for part in kept):
        raise SetupFailed("capabilities left after capset")


# The worker and its supervisor -------------------------------------------------------------------------------------


def supervise(spec: dict, code: str) -> None:
    """Fork the worker, reap every child (in a PID namespace, orphans come here) until it ends, report how."""
    worker = os.fork()
    if worker == 0:
        run(spec, code)
    while True:
        pid, status = os.wait()
        if pid == worker:
            break
    report(f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")
    os._exit(0)


class RunCode(BaseException):
    """Raised by the worker once its limits are set: it unwinds every frame of the setup, and the module's end runs
    the code at top level, as ``python -c`` would (an uncaught exception, ``sys.exit``, threads and ``atexit``
    behave as they do there), without the cost of starting another interpreter."""


def run(spec: dict, code: str) -> None:
    limits = spec["limits"]
    bounds = [
        (resource.RLIMIT_AS, limits["address_space_bytes"]),
        (resource.RLIMIT_CPU, limits["cpu_s"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_CORE, 0),
    ]
    if spec["isolate"]:
        os.chdir("/tmp")
        # Counted per user and user namespace: the box's own user counts the box's processes alone. Unisolated it
        # would count the caller's own threads and processes too.
        bounds.append((resource.RLIMIT_NPROC, limits["processes"]))
    for which, bound in bounds:
        resource.setrlimit(which, (bound, bound))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the code's Ctrl-C, as in any interpreter
    if spec["syscall_filter"]:
        filter_system_calls(spec["syscall_filter"])
    raise RunCode


def filter_system_calls(program: bytes) -> None:
    """Install the seccomp ``program`` on this process and every one it starts; none can remove it. The last step
    before the code: the box's own setup above needs calls it refuses (unshare, mount, pivot_root). Unprivileged,
    the kernel takes a filter only once ``no_new_privs`` is set (init set it)."""
    fprog = SockFprog(len(program) // SOCK_FILTER_BYTES, program)
    mode, unused = ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.c_ulong(0)  # C longs: prctl(2) is variadic
    call(libc.prctl(PR_SET_SECCOMP, mode, ctypes.byref(fprog), unused, unused), "prctl(PR_SET_SECCOMP)")


def guarded(step, *args) -> None:
    """Run a process's ``step``; a failure to build is reported, never raised into a second copy of the caller.
    Only the worker leaves it alive, by RunCode."""
    try:
        step(*args)
    except Exception as error:  # whatever failed, the box was not built: said, and this process ends
        report(f"setup {error}" if isinstance(error, (OSError, SetupFailed)) else f"setup {error!r}")
    os._exit(1)


if __name__ == "__main__":
    spec = marshal.loads(bytes.fromhex(sys.argv[1]))
    STATUS_FD = spec["status_fd"]
    try:
        guarded(start, spec, sys.argv[2])
    except RunCode:  # only the worker gets here: every other process ends in guarded
        code = sys.argv[2]
    # The worker, now the code's interpreter (outside the handler: the code's own errors chain to nothing).
    os.close(STATUS_FD)
    sys.argv = ["-c"]
    os.environ.clear()  # empty: the interpreter coerced its C locale to UTF-8 already
    del spec
    # The builtins site adds (exit, quit, help), without site-packages: the code gets the standard library alone,
    # whatever the interpreter's install holds, and is spared processing its .pth files.
    import site

    site.setquit()
    site.setcopyright()
    site.sethelper()
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
