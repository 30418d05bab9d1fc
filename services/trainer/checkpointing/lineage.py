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

Records are typed (``StepRecord``, ``RestartRecord``, ``LostRecord``, ``ReopenedRecord``) and carry the
format version ``v``; a line without one was written before versions were kept and is version 1. Reading
validates every complete line: a malformed line or one of an unknown version raises ``LineageError`` naming
the file and line, since skipping it would silently change which steps make up the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from services.common.files import fsync_folder, write_atomically

TAIL_BYTES = 1 << 20  # longer than any one record: a torn line starts within the file's last MiB
LINEAGE_VERSION = 1


class LineageError(ValueError):
    """A complete line of lineage.jsonl that is not a record this build reads; the text names the line."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def line(self) -> bytes:
        # Defaults left out: a step without filtered groups, a restart without a disowned range keep the shape
        # that files written before those fields had.
        return json.dumps({"v": LINEAGE_VERSION, **self.model_dump(mode="json", exclude_defaults=True)}).encode()


class StepRecord(_Record):
    """One applied step: the groups it applied (with the policy version that generated each), dropped as stale
    and filtered out by dynamic sampling, and the last EXPERIENCE sequence read."""

    step: int
    policy_version: int
    groups: list[tuple[str, int]]
    dropped_stale: list[str]
    experience_seq: int
    filtered: list[str] = []


class RestartRecord(_Record):
    """Training goes on from checkpoint ``from_step`` (a resume, a restart from base weights or a rollback)."""

    event: Literal["resume", "restart", "rollback"]
    from_step: int
    policy_version: int
    abandoned_steps: list[int]
    abandoned_versions: tuple[int, int] | None = None  # inclusive; a rollback's disowned policy versions
    requested: bool = False  # a resume to the step the operator named (checkpoint.resume_step)


class LostRecord(_Record):
    """Groups written off as lost at ``at_step``."""

    lost: list[str]
    at_step: int


class ReopenedRecord(_Record):
    """A dead group re-injected from DEAD sequence ``dead_letter``: in flight again."""

    reopened: str
    dead_letter: int
    at_step: int


LineageRecord = StepRecord | RestartRecord | LostRecord | ReopenedRecord
# The key that tells each kind of record apart, as files have always been written.
_KIND_BY_KEY: dict[str, type[_Record]] = {
    "step": StepRecord,
    "event": RestartRecord,
    "lost": LostRecord,
    "reopened": ReopenedRecord,
}


def parse_record(line: str, where: str) -> LineageRecord:
    """One line of lineage.jsonl as its record; ``where`` (file and line number) heads any error."""
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as error:
        raise LineageError(f"{where}: not JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(fields, dict):
        raise LineageError(f"{where}: a record is a JSON object, got {type(fields).__name__}")
    version = fields.pop("v", 1)
    if version != LINEAGE_VERSION:
        raise LineageError(f"{where}: lineage format version {version!r}; this build reads {LINEAGE_VERSION}")
    kinds = [kind for key, kind in _KIND_BY_KEY.items() if key in fields]
    if len(kinds) != 1:
        expected = sorted(_KIND_BY_KEY)
        raise LineageError(f"{where}: a record has exactly one of the keys {expected}, got {sorted(fields)}")
    try:
        return kinds[0].model_validate(fields)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise LineageError(f"{where}: not a valid {kinds[0].__name__}: {problems}") from None


class Lineage:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def _append(self, record: LineageRecord) -> None:
        created = not self.path.exists()
        with self.path.open("ab+") as out:
            # A crash mid-write leaves a torn last line: cut it off, so the record after it stays readable.
            end = out.tell()
            if end > 0:
                out.seek(max(end - TAIL_BYTES, 0))
                tail = out.read()
                if not tail.endswith(b"\n"):
                    out.truncate(end - len(tail) + tail.rfind(b"\n") + 1)
            out.write(record.line() + b"\n")
            out.flush()
            os.fsync(out.fileno())
        if created:
            fsync_folder(self.path.parent)

    def records(self) -> list[LineageRecord]:
        """Every complete record; a torn last line (a crash mid-write) was never a record. Raises
        ``LineageError`` on a complete line that is not one."""
        if not self.path.exists():
            return []
        return [
            parse_record(line, f"{self.path}:{number}")
            for number, line in enumerate(self.path.read_text().split("\n")[:-1], start=1)
            if line.strip()
        ]

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
        # filtered: dynamic sampling's; a rollback undoes them as it does the step's applied and dropped groups.
        self._append(
            StepRecord(
                step=step,
                policy_version=version,
                groups=groups,
                dropped_stale=dropped,
                experience_seq=experience_seq,
                filtered=list(filtered),
            )
        )

    def record_lost(self, step: int, group_ids: list[str]) -> None:
        """Groups that never came back: neither applied, dropped nor dead-lettered within the bound."""
        self._append(LostRecord(lost=group_ids, at_step=step))

    def record_reopened(self, step: int, group_id: str, dead_letter: int) -> None:
        """A dead-lettered group re-injected from DEAD sequence ``dead_letter``: no longer dead, in flight again."""
        self._append(ReopenedRecord(reopened=group_id, dead_letter=dead_letter, at_step=step))

    def restart_from(
        self,
        step: int,
        version: int,
        event: Literal["resume", "restart", "rollback"],
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
        abandoned = [r.step for r in effective_steps(self.records()) if r.step > step]
        self._append(
            RestartRecord(
                event=event,
                from_step=step,
                policy_version=version,
                abandoned_steps=abandoned,
                abandoned_versions=abandoned_versions,
                requested=requested,
            )
        )
        return abandoned

    def abandoned_versions(self) -> list[tuple[int, int]]:
        """The inclusive policy-version ranges that rollbacks disowned."""
        return [
            r.abandoned_versions
            for r in self.records()
            if isinstance(r, RestartRecord) and r.abandoned_versions is not None
        ]

    def resumed_to(self, step: int) -> bool:
        """Whether a resume to ``step`` that the operator asked for (``checkpoint.resume_step``) was made."""
        return any(
            isinstance(r, RestartRecord) and r.event == "resume" and r.requested and r.from_step == step
            for r in self.records()
        )

    def max_version(self) -> int:
        return max((r.policy_version for r in self.records() if isinstance(r, StepRecord | RestartRecord)), default=0)


def effective_steps(records: list[LineageRecord]) -> list[StepRecord]:
    """The step records that make up the current model, oldest first."""
    steps: list[StepRecord] = []
    for record in records:
        if isinstance(record, RestartRecord):
            steps = [s for s in steps if s.step <= record.from_step]
        elif isinstance(record, StepRecord):
            steps.append(record)
    return steps


def settled_after(records: list[LineageRecord], step: int) -> list[str]:
    """The groups the effective steps after ``step`` applied, dropped as stale or filtered: what a rollback to
    ``step`` undoes."""
    return [
        group
        for record in effective_steps(records)
        if record.step > step
        for group in [*(group_id for group_id, _ in record.groups), *record.dropped_stale, *record.filtered]
    ]


def lost_groups(records: list[LineageRecord]) -> list[str]:
    """Every group written off as lost, in the order it was."""
    return [group for record in records if isinstance(record, LostRecord) for group in record.lost]
