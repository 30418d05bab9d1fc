"""One check of ``rlpipe verify``: its name, its verdict and the evidence (services/cli/verify/checklist.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str  # the evidence, or what failed
