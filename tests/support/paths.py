"""Where the tests find the repository, the environment's executables and the shared test models."""

from __future__ import annotations

import contextlib
import fcntl
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TEST_MODEL_DIR = ROOT / "build" / "test-model"


@contextlib.contextmanager
def one_builder(name: str) -> Iterator[None]:
    """Held while a shared test artefact under build/test-model is built or checked: pytest-xdist workers each ask
    for it, so one builds (or rewrites its data files) while the others wait, then reuse it."""
    TEST_MODEL_DIR.mkdir(parents=True, exist_ok=True)
    with open(TEST_MODEL_DIR / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
