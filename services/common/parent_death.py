"""Processes that die with their parent: the launcher's children, the warm starter's forks, torchrun's ranks."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int | None = None) -> None:
    """Linux: this process gets SIGKILL when its parent dies, however the parent dies, so nothing is orphaned.
    ``parent``: the pid the parent had before the fork, when known; a parent that died between the fork and this
    call re-parented the process before it could ask for the signal, so it kills itself now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def dies_with_this_process() -> Callable[[], None]:
    """A ``preexec_fn`` for a child that must die with this process (``die_with_parent`` with this pid)."""
    return functools.partial(die_with_parent, os.getpid())
