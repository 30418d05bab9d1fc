"""Local files written so that a crash or a concurrent reader never sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Write-then-rename: a crash never leaves a half-written file under the real name, and a
    reader sees the old content or the new, never part of it. Once it returns, the new content
    survives a node crash too: the folder is synced after the rename."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as tmp:
        tmp.write(data)
        tmp.flush()
        os.fsync(tmp.fileno())
    os.replace(tmp.name, path)
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Make a rename or a new file in ``folder`` durable: the entry lives in the folder, not in the file."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
