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

The file grows with the run (20,000 steps took 3.9 s to parse whole), so what the trainer asks of it between steps
(the highest policy version, the steps an adoption abandons, the disowned versions, the requested resumes) is kept
in a ``LineageIndex`` that reads each line once: an append adds its own record, and a read first takes in whatever
was appended since the last (at start, the whole file: ``catch_up``, which the trainer runs off its event loop).
``records`` still parses the whole file, for a rollback's list of undone groups and for the tests' audits.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
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
_KIND_BY_KEY: dict[str, type[LineageRecord]] = {
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


@dataclass
class LineageIndex:
    """What the trainer asks of the lineage, from the records read so far: ``end`` bytes of complete lines."""

    end: int = 0
    lines: int = 0  # lines read, blank ones included: numbers the next line in an error
    max_version: int = 0  # the highest policy version a step or restart record names
    steps: list[int] = field(default_factory=list)  # the effective steps, oldest first (``effective_steps``)
    abandoned_versions: list[tuple[int, int]] = field(default_factory=list)  # rollbacks' disowned ranges
    requested_resumes: set[int] = field(default_factory=set)  # steps of resumes the operator asked for

    def add(self, record: LineageRecord) -> None:
        if isinstance(record, StepRecord):
            self.steps.append(record.step)
        elif isinstance(record, RestartRecord):
            self.steps = [step for step in self.steps if step <= record.from_step]
            if record.abandoned_versions is not None:
                self.abandoned_versions.append(record.abandoned_versions)
            if record.event == "resume" and record.requested:
                self.requested_resumes.add(record.from_step)
        if isinstance(record, StepRecord | RestartRecord):
            self.max_version = max(self.max_version, record.policy_version)


def requested_resumes(text: str, where: str) -> set[int]:
    """The steps of the resumes an operator asked for (``checkpoint.resume_step``) that the lineage ``text`` records
    (a checkpoint's copy, complete lines only); ``where`` names it in a ``LineageError``."""
    index = LineageIndex()
    for number, line in enumerate(text.split("\n")[:-1], start=1):
        if line.strip():
            index.add(parse_record(line, f"{where}:{number}"))
    return index.requested_resumes


class Lineage:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # Appends run on worker threads (their fsync) while the loop reads the index: one at a time.
        self.lock = threading.Lock()
        self.index = LineageIndex()

    def _append(self, record: LineageRecord) -> None:
        created = not self.path.exists()
        line = record.line() + b"\n"
        with self.lock, self.path.open("ab+") as out:
            end = out.seek(0, os.SEEK_END)
            if end > 0:
                out.seek(end - 1)
                if out.read(1) != b"\n":
                    # A crash mid-write left a torn last line: cut it off, so the record after it stays readable.
                    out.seek(max(end - TAIL_BYTES, 0))
                    tail = out.read()
                    end = end - len(tail) + tail.rfind(b"\n") + 1
                    out.truncate(end)
            out.write(line)
            out.flush()
            os.fsync(out.fileno())
            if self.index.end == end:  # the index had read up to here: it takes this record as written
                self.index.add(record)
                self.index.end += len(line)
                self.index.lines += 1
        if created:
            fsync_folder(self.path.parent)

    def catch_up(self) -> LineageIndex:
        """The index, after reading the lines appended since it last read (all of them the first time); a file
        that shrank (replaced) is read anew. Raises ``LineageError`` on a complete line that is not a record, and
        then keeps the index as it was."""
        with self.lock:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size < self.index.end:
                self.index = LineageIndex()
            if size == self.index.end:
                return self.index
            with self.path.open("rb") as source:
                source.seek(self.index.end)
                data = source.read(size - self.index.end)
            complete = data[: data.rfind(b"\n") + 1]
            lines = complete.split(b"\n")[:-1]
            records = [
                parse_record(line.decode(), f"{self.path}:{self.index.lines + number}")
                for number, line in enumerate(lines, start=1)
                if line.strip()
            ]
            for record in records:
                self.index.add(record)
            self.index.end += len(complete)
            self.index.lines += len(lines)
            return self.index

    def records(self) -> list[LineageRecord]:
        """Every complete record, parsed from the whole file; a torn last line (a crash mid-write) was never a
        record. Raises ``LineageError`` on a complete line that is not one."""
        if not self.path.exists():
            return []
        return [
            parse_record(line, f"{self.path}:{number}")
            for number, line in enumerate(self.path.read_text().split("\n")[:-1], start=1)
            if line.strip()
        ]

    def text(self, upto: int | None = None) -> str:
        """The file, or its first ``upto`` bytes (``catch_up().end``: its complete lines as of then)."""
        if not self.path.exists() or upto == 0:
            return ""
        with self.path.open("rb") as source:
            return source.read(-1 if upto is None else upto).decode()

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
        abandoned = [s for s in self.catch_up().steps if s > step]
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
        return list(self.catch_up().abandoned_versions)

    def resumed_to(self, step: int) -> bool:
        """Whether a resume to ``step`` that the operator asked for (``checkpoint.resume_step``) was made."""
        return step in self.catch_up().requested_resumes

    def max_version(self) -> int:
        return self.catch_up().max_version


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
    """Every group written off as lost that the run still holds so, in the order it was. A write-off made after the
    checkpoint a new process goes on from (a resume or a restart) is forgotten with the process that made it: the
    adopted checkpoint's ledger never knew it, and the group may be applied later. A rollback keeps its process's
    write-offs (its ledger keeps lost groups settled)."""
    kept: list[LostRecord] = []
    for record in records:
        if isinstance(record, RestartRecord) and record.event != "rollback":
            kept = [lost for lost in kept if lost.at_step < record.from_step]
        elif isinstance(record, LostRecord):
            kept.append(record)
    return [group for record in kept for group in record.lost]
