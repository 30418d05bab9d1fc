"""``runs/<run>/lineage.jsonl``: which groups trained which step, append-only.

One line per applied step (step, policy version after it, the groups applied with the
version that generated each, the groups dropped as stale, the last EXPERIENCE sequence
read), one line per resume, restart or rollback, naming the steps and policy versions it
abandoned, one line per batch of groups written off as lost, and one line per dead group that
an operator re-injected (``rlpipe dead-letters --reinject``), which is in flight again (a trainer
resumed from a checkpoint older than that line reopens the group again, and writes it again). The steps
that make up the current model are the recorded steps minus the abandoned ones; that
list is how operators answer "which samples trained step N" and how the tests prove
that every group was applied exactly once.

Every record is fsynced before ``_append`` returns: the highest policy version in the file is
the floor for the versions a restarted trainer serves (a rollout holding a version it already
has never pulls again), so a node crash must not take back a record of a version served.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.transport.storage import fsync_folder, write_atomically

TAIL_BYTES = 1 << 20  # longer than any one record: a torn line starts within the file's last MiB


class Lineage:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def _append(self, record: dict[str, Any]) -> None:
        created = not self.path.exists()
        with self.path.open("ab+") as out:
            # A crash mid-write leaves a torn last line: cut it off, so the record after it stays readable.
            end = out.tell()
            if end > 0:
                out.seek(max(end - TAIL_BYTES, 0))
                tail = out.read()
                if not tail.endswith(b"\n"):
                    out.truncate(end - len(tail) + tail.rfind(b"\n") + 1)
            out.write(json.dumps(record).encode() + b"\n")
            out.flush()
            os.fsync(out.fileno())
        if created:
            fsync_folder(self.path.parent)

    def records(self) -> list[dict[str, Any]]:
        """Every complete record; a torn last line (a crash mid-write) was never a record."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().split("\n")[:-1] if line.strip()]

    def text(self) -> str:
        return self.path.read_text() if self.path.exists() else ""

    def record_step(
        self,
        step: int,
        version: int,
        groups: list[tuple[str, int]],
        dropped: list[str],
        experience_seq: int,
        filtered: Sequence[str] = (),
    ) -> None:
        record = {
            "step": step,
            "policy_version": version,
            "groups": groups,
            "dropped_stale": dropped,
            "experience_seq": experience_seq,
        }
        if filtered:  # dynamic sampling's: a rollback undoes them as it does the step's applied and dropped groups
            record["filtered"] = list(filtered)
        self._append(record)

    def record_lost(self, step: int, group_ids: list[str]) -> None:
        """Groups that never came back: neither applied, dropped nor dead-lettered within the bound."""
        self._append({"lost": group_ids, "at_step": step})

    def record_reopened(self, step: int, group_id: str, dead_letter: int) -> None:
        """A dead-lettered group re-injected from DEAD sequence ``dead_letter``: no longer dead, in flight again."""
        self._append({"reopened": group_id, "dead_letter": dead_letter, "at_step": step})

    def restart_from(
        self,
        step: int,
        version: int,
        event: str,
        copy_if_missing: str = "",
        abandoned_versions: tuple[int, int] | None = None,
        requested: bool = False,
    ) -> list[int]:
        """Record that training goes on from checkpoint ``step``; returns the steps this abandons.

        A rollback also names the policy versions it disowns (``abandoned_versions``, an
        inclusive range): groups those versions generated are dropped, never trained on. ``requested``: a resume
        to the step the operator named (``checkpoint.resume_step``), which later restarts do not repeat.
        """
        if not self.path.exists() and copy_if_missing:
            write_atomically(self.path, copy_if_missing.encode())
        abandoned = [r["step"] for r in effective_steps(self.records()) if r["step"] > step]
        record = {"event": event, "from_step": step, "policy_version": version, "abandoned_steps": abandoned}
        if abandoned_versions is not None:
            record["abandoned_versions"] = list(abandoned_versions)
        if requested:
            record["requested"] = True
        self._append(record)
        return abandoned

    def abandoned_versions(self) -> list[tuple[int, int]]:
        """The inclusive policy-version ranges that rollbacks disowned."""
        return [tuple(r["abandoned_versions"]) for r in self.records() if "abandoned_versions" in r]

    def resumed_to(self, step: int) -> bool:
        """Whether a resume to ``step`` that the operator asked for (``checkpoint.resume_step``) was made."""
        return any(r.get("event") == "resume" and r.get("requested") and r["from_step"] == step for r in self.records())

    def max_version(self) -> int:
        return max((r.get("policy_version", 0) for r in self.records()), default=0)


def effective_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records that make up the current model, oldest first."""
    steps: list[dict[str, Any]] = []
    for record in records:
        if "event" in record:
            steps = [s for s in steps if s["step"] <= record["from_step"]]
        elif "step" in record:
            steps.append(record)
    return steps


def settled_after(records: list[dict[str, Any]], step: int) -> list[str]:
    """The groups the effective steps after ``step`` applied, dropped as stale or filtered: what a rollback to
    ``step`` undoes."""
    return [
        group
        for record in effective_steps(records)
        if record["step"] > step
        for group in [
            *(group_id for group_id, _ in record["groups"]),
            *record["dropped_stale"],
            *record.get("filtered", []),
        ]
    ]


def lost_groups(records: list[dict[str, Any]]) -> list[str]:
    """Every group written off as lost, in the order it was."""
    return [group for record in records for group in record.get("lost", [])]
