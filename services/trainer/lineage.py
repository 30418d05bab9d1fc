"""``runs/<run>/lineage.jsonl``: which groups trained which step, append-only.

One line per applied step (step, policy version after it, the groups applied with the
version that generated each, the groups dropped as stale, the last EXPERIENCE sequence
read) and one line per resume or rollback, naming the steps it abandoned. The steps
that make up the current model are the recorded steps minus the abandoned ones; that
list is how operators answer "which samples trained step N" and how the tests prove
that every group was applied exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Lineage:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def _append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def text(self) -> str:
        return self.path.read_text() if self.path.exists() else ""

    def record_step(
        self, step: int, version: int, groups: list[tuple[str, int]], dropped: list[str], experience_seq: int
    ) -> None:
        self._append(
            {
                "step": step,
                "policy_version": version,
                "groups": groups,
                "dropped_stale": dropped,
                "experience_seq": experience_seq,
            }
        )

    def restart_from(
        self,
        step: int,
        version: int,
        event: str,
        copy_if_missing: str = "",
        abandoned_versions: tuple[int, int] | None = None,
    ) -> list[int]:
        """Record that training goes on from checkpoint ``step``; returns the steps this abandons.

        A rollback also names the policy versions it disowns (``abandoned_versions``, an
        inclusive range): groups those versions generated are dropped, never trained on.
        """
        if not self.path.exists() and copy_if_missing:
            self.path.write_text(copy_if_missing)
        abandoned = [r["step"] for r in effective_steps(self.records()) if r["step"] > step]
        record = {"event": event, "from_step": step, "policy_version": version, "abandoned_steps": abandoned}
        if abandoned_versions is not None:
            record["abandoned_versions"] = list(abandoned_versions)
        self._append(record)
        return abandoned

    def abandoned_versions(self) -> list[tuple[int, int]]:
        """The inclusive policy-version ranges that rollbacks disowned."""
        return [tuple(r["abandoned_versions"]) for r in self.records() if "abandoned_versions" in r]

    def max_version(self) -> int:
        return max((r.get("policy_version", 0) for r in self.records()), default=0)


def effective_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records that make up the current model, oldest first."""
    steps: list[dict[str, Any]] = []
    for record in records:
        if "event" in record:
            steps = [s for s in steps if s["step"] <= record["from_step"]]
        else:
            steps.append(record)
    return steps
