"""Which stored step a starting trainer resumes from, and the run's own record that it saved one.

"Unreadable" is never read as "empty". A store that cannot be listed may hold the run's newest step, so a resume
that meets one waits (``ResumeBlocked``) rather than taking an older step from another store or none at all. And
a run that has saved before knows it without asking the store: after every save (and every resume or rollback,
which moves the newest live step) it writes ``runs/<run>/checkpoint-saved.json``, fsynced. A store that lists
nothing while that record names a step is missing what the run wrote (a bucket re-created empty, a volume not
mounted), and the resume waits for it too; it never starts again from base weights.

The decision (``resume_candidates``) is pure: what each store listed in, the steps to try out.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from services.common.files import write_atomically


class ResumeBlocked(RuntimeError):
    """The checkpoint a resume needs cannot be read now; waiting for the store may help."""


class StoreUnreadable(ResumeBlocked):
    """A store could not be listed, and it may hold a newer step than the readable stores offer."""


class CheckpointsMissing(ResumeBlocked):
    """The stores list no step of this run although the run's own record says it saved one."""


@dataclass(frozen=True)
class StoreListing:
    """One store's answer to "which live steps of this run do you hold"."""

    url: str
    steps: list[int] | None  # None: the listing failed, after retries
    error: str = ""
    abandoned: frozenset[int] = frozenset()  # steps whose copy here is marked ABANDONED


def resume_candidates(listings: list[StoreListing], saved_step: int | None) -> list[tuple[int, str]]:
    """(step, store url) to try loading, newest step first and, for one step, in the order the stores came.

    ``saved_step``: the newest live step the run's own record says it saved (None: no record). Raises
    StoreUnreadable when an unlisted store may hold a newer step than the listed ones (none listed, or only older
    than ``saved_step``), CheckpointsMissing when every store listed and none holds a step the record says exists.
    An empty list means the run never saved: a start without a checkpoint is right.

    The first listing is the primary store's, which a rollback marks first and every save writes first. A step it
    marks ABANDONED is no candidate in a later store either (a mirror out of reach during the rollback still holds it
    live), unless the primary holds it live too (saved again on the new branch). Nor is a later store's step newer
    than both the primary's newest live step and ``saved_step``: the primary pruned its ABANDONED copy at its next save
    while the mirror, out of reach, kept the old branch's live (a damaged primary copy still lists, so its step stays
    a candidate on the mirror). Only a primary that lists no step at all, with no record, leaves the mirror's
    steps uncapped: the mirror is then the run's only copy."""
    primary = listings[0] if listings and listings[0].steps is not None else None
    disowned = primary.abandoned - set(primary.steps or ()) if primary is not None else frozenset()
    # The newest step a later store may offer; None: any.
    known = [*(primary.steps or ()), *([saved_step] if saved_step is not None else [])] if primary is not None else []
    ceiling = max(known, default=None)
    candidates = [
        (step, listing.url)
        for listing in listings
        if listing.steps is not None
        for step in listing.steps
        if listing is primary or (step not in disowned and (ceiling is None or step <= ceiling))
    ]
    candidates.sort(key=lambda candidate: -candidate[0])  # stable: for one step, the stores keep their order
    newest = candidates[0][0] if candidates else None
    unreadable = [listing for listing in listings if listing.steps is None]
    expected = f"step {saved_step}, which this run's record says it saved" if saved_step is not None else None
    if unreadable and (newest is None or (saved_step is not None and newest < saved_step)):
        failures = "; ".join(f"{listing.url}: {listing.error}" for listing in unreadable)
        found = f"the readable stores' newest is step {newest}" if newest is not None else "no store could be read"
        wanted = expected or "the run's newest step"
        raise StoreUnreadable(f"cannot list the checkpoint store ({failures}); {found}, and {wanted} may be there")
    if newest is None and saved_step is not None:
        stores = ", ".join(listing.url for listing in listings)
        raise CheckpointsMissing(f"{stores} holds no checkpoint of this run, but {expected}")
    return candidates


def fenced_out(live: list[tuple[int, int | None]]) -> set[int]:
    """The steps of ``live`` ((step, the lease epoch its manifest names), oldest first) that a fenced-out writer
    landed: a lower epoch than an older live step's. The fence check and the write are two requests, so a trainer
    paused between them can land one manifest after its successor's; no step of the current branch is written under
    a lower epoch than an older one. A step without an epoch (a writer without a lease) is never judged."""
    highest, found = None, set()
    for step, epoch in live:
        if epoch is None:
            continue
        if highest is not None and epoch < highest:
            found.add(step)
        else:
            highest = epoch
    return found


@dataclass(frozen=True)
class SavedRecord:
    """``checkpoint-saved.json``: the newest live step this run stored, and the highest policy version it served
    by then."""

    step: int
    policy_version: int
    incarnation: str
    location: str  # where the step was stored, for the operator

    FILE = "checkpoint-saved.json"

    @classmethod
    def read(cls, run_dir: Path) -> SavedRecord | None:
        """The record in ``run_dir``; None when the run never saved (or started afresh since)."""
        path = run_dir / cls.FILE
        if not path.exists():
            return None
        try:
            raw = json.loads(path.read_text())
            return cls(
                step=int(raw["step"]),
                policy_version=int(raw["policy_version"]),
                incarnation=str(raw["incarnation"]),
                location=str(raw["location"]),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a checkpoint record ({error!r}); move it away to resume anyway") from None

    def write(self, run_dir: Path) -> None:
        """Replace the record, fsynced: a node crash leaves the old record or this one."""
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(run_dir / self.FILE, json.dumps(asdict(self)).encode())

    @classmethod
    def clear(cls, run_dir: Path) -> None:
        """A fresh start: an earlier run's record under this run id is not this run's."""
        (run_dir / cls.FILE).unlink(missing_ok=True)
