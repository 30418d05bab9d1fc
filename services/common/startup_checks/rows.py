"""What a check returns (a row of name, status and detail), what a config-dependent check is, and how a
list of them runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from services.common.config import RunConfig

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == "fail"


@dataclass(frozen=True)
class Check:
    """A config-dependent check: the top-level config fields it reads, and what it does with them."""

    name: str
    fields: tuple[str, ...]
    run: Callable[[RunConfig], list[CheckResult]]


class StartupCheckError(RuntimeError):
    """A service cannot start; the message names every failed check."""

    def __init__(self, role: str, failures: list[CheckResult]):
        self.failures = failures
        lines = "\n".join(f"  {result.name}: {result.detail}" for result in failures)
        super().__init__(f"{role} start-up checks failed:\n{lines}")


def shorten(error: BaseException | str, limit: int = 300) -> str:
    """``error`` (an exception, or a program's error output) in at most ``limit`` characters."""
    text = error if isinstance(error, str) else str(error) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def human_size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def run_each(checks: list[Check], cfg: RunConfig | None, invalid: frozenset[str]) -> list[CheckResult]:
    """Each check's rows; a check is skipped, with a row saying why, without a config or with a field of it invalid."""
    results = []
    for check in checks:
        if cfg is None:
            results.append(CheckResult(check.name, "skip", "needs a loadable config"))
            continue
        broken = [field for field in check.fields if field in invalid]
        if broken:
            results.append(CheckResult(check.name, "skip", f"invalid config: {', '.join(broken)} (see config)"))
            continue
        results += check.run(cfg)
    return results
