"""The recovery simulation's oracle (docs/testing.md): what became of every group, kept from what the simulated world
saw happen, never from the trainer's own bookkeeping.

It hears of a prompt landing on PROMPTS (``prompt_landed``), a dead letter written and an operator's re-inject
(``dead_lettered``, ``reinjected``), a write-off (``written_off``), every step the learner trained and every weights
it loaded (``trained``, ``loaded``: the simulated weights are a fingerprint of the steps that made them, so the oracle
knows which history the model holds after any resume or rollback), and every store write with the lease epoch of its
writer (``store_written``). From those alone it gives each fed group its fate (``fate``): applied, dropped or
filtered by a step of the model, written off as lost, or dead (a letter whose message was not re-injected) — and
checks the trainer against it (``check_trainer`` after every op, ``check_final`` after the scenario's drain): the
learner's weights are what the lineage's steps make, no group is in the model twice, and what the ledger says (in
flight, settled, under its watermark) agrees with the fates the world saw.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

from services.trainer.checkpointing.lineage import LineageRecord, effective_steps
from services.trainer.intake.ledger import Fate, GroupLedger, feed_position, feeding_order
from services.trainer.intake.reader import Collected
from tests.trainer.sim_fakes import fold


class InvariantBroken(AssertionError):
    pass


@dataclass(frozen=True)
class Step:
    """A step the learner trained: the weights it started from, its number, and what it settled."""

    parent: int
    number: int
    settled: dict[str, str]  # group -> applied, dropped or filtered


@dataclass(frozen=True)
class TrainerView:
    """What the checks read of the live trainer: its claims, to be held against the world's record."""

    incarnation: str
    fingerprint: int  # the learner's weights
    records: list[LineageRecord]
    ledger: GroupLedger
    cursor: tuple[int, int]  # where the feeder feeds next (epoch, position)
    pending: set[str]  # groups of this incarnation waiting on PROMPTS or unread in EXPERIENCE


class Oracle:
    def __init__(self) -> None:
        self.fed: defaultdict[str, set[str]] = defaultdict(set)  # incarnation -> groups whose prompt landed
        self.steps: dict[int, Step] = {}  # weights fingerprint -> the step that made them
        self.letters: defaultdict[tuple[str, str], set[str]] = defaultdict(set)  # (incarnation, group) -> origins
        self.reinjected_origins: set[str] = set()  # "<stream>:<sequence>" of the messages re-injected from DEAD
        self.lost: defaultdict[tuple[str, str], list[int]] = defaultdict(list)  # (incarnation, group) -> moments
        self.now = 0  # the world's moments: when a write-off was made, when a checkpoint's state was copied
        self.fence = 0  # the highest lease epoch that claimed the store
        self.violations: list[str] = []  # seen inside a component (which may catch any exception): raised by ``check``
        self._models: dict[int, dict[str, tuple[str, int]]] = {0: {}}

    # -- what the world saw ----------------------------------------------------------------

    def prompt_landed(self, incarnation: str, group_id: str) -> None:
        self.fed[incarnation].add(group_id)

    def dead_lettered(self, incarnation: str, group_id: str, origin: str) -> None:
        self.letters[(incarnation, group_id)].add(origin)

    def reinjected(self, incarnation: str, group_id: str, origin: str) -> None:
        self.reinjected_origins.add(origin)

    def moment(self) -> int:
        self.now += 1
        return self.now

    def written_off(self, incarnation: str, group_ids: list[str]) -> None:
        for group_id in group_ids:
            self.lost[(incarnation, group_id)].append(self.moment())

    def resumed(self, incarnation: str, copied_at: int) -> None:
        """A process resumed from a checkpoint copied at ``copied_at``: its memory is the checkpoint's, so the
        write-offs made after it are forgotten (its lineage.jsonl keeps their records, see docs/testing.md)."""
        for (inc, _), moments in self.lost.items():
            if inc == incarnation:
                moments[:] = [m for m in moments if m <= copied_at]

    def trained(self, before: int, after: int, collected: Collected, incarnation: str) -> None:
        if before and before not in self.steps:
            self.violations.append(f"a step trained on weights {before:x} that no step made")
            return
        number = self.steps[before].number + 1 if before else 1
        settled: dict[str, str] = {}
        history = self.model(before)
        named = [(g.group_id, "applied") for g in collected.batch]
        named += [(g, "dropped") for g in collected.dropped] + [(g, "filtered") for g in collected.filtered]
        for group_id, how in named:
            earlier = history.get(group_id) or ((settled[group_id], number) if group_id in settled else None)
            if earlier is not None:
                self.violations.append(
                    f"step {number} {how} {group_id}, which step {earlier[1]} of the same model {earlier[0]}"
                )
            settled[group_id] = how
        foreign = [g.group_id for g in collected.batch if g.incarnation != incarnation]
        if foreign:
            self.violations.append(f"step {number} of incarnation {incarnation} trained other incarnations' {foreign}")
        self.steps.setdefault(after, Step(before, number, settled))

    def loaded(self, fingerprint: int) -> None:
        if fingerprint and fingerprint not in self.steps:
            self.violations.append(f"the learner loaded weights {fingerprint:x} that no step made")

    def fence_claimed(self, epoch: int) -> None:
        self.fence = max(self.fence, epoch)

    def store_written(self, url: str, key: str, epoch: int | None) -> None:
        if epoch is not None and epoch < self.fence:
            self.violations.append(
                f"a trainer of lease epoch {epoch} wrote {url}{key} after epoch {self.fence} took over"
            )

    # -- what it makes of it ---------------------------------------------------------------

    def model(self, fingerprint: int) -> dict[str, tuple[str, int]]:
        """The groups the steps that made these weights settled: group -> (applied/dropped/filtered, step)."""
        if fingerprint not in self._models:
            step = self.steps[fingerprint]
            history = dict(self.model(step.parent))
            history.update({group: (how, step.number) for group, how in step.settled.items()})
            self._models[fingerprint] = history
        return self._models[fingerprint]

    def numbers(self, fingerprint: int) -> list[int]:
        """The step numbers that made these weights, oldest first."""
        numbers = []
        while fingerprint:
            numbers.append(self.steps[fingerprint].number)
            fingerprint = self.steps[fingerprint].parent
        return numbers[::-1]

    def fate(self, incarnation: str, group_id: str, model: dict[str, tuple[str, int]]) -> str | None:
        """The fate the world gave ``group_id``: applied, dropped or filtered in the model, lost, dead, or None."""
        if group_id in model:
            return model[group_id][0]
        if self.lost[(incarnation, group_id)]:
            return "lost"
        if self.letters[(incarnation, group_id)] - self.reinjected_origins:
            return "dead"
        return None

    # -- the checks ------------------------------------------------------------------------

    def check_served(self, served: list[int]) -> None:
        if self.violations:
            raise InvariantBroken(self.violations[0])
        if any(later <= earlier for earlier, later in itertools.pairwise(served)):
            raise InvariantBroken(f"policy versions served did not only grow: {served}")

    def check_trainer(self, t: TrainerView) -> None:
        """The live trainer against the world: weights against lineage, and the ledger's claims against the fates."""
        replayed = 0
        steps = effective_steps(t.records)
        for record in steps:
            replayed = fold(replayed, record.groups, record.dropped_stale, record.filtered)
        if replayed != t.fingerprint:
            raise InvariantBroken(
                f"the learner's weights are those of steps {self.numbers(t.fingerprint)}, but replaying the lineage's "
                f"steps {[r.step for r in steps]} gives other weights"
            )
        model, ledger, inc = self.model(t.fingerprint), t.ledger, t.incarnation
        unsettled = ledger.in_flight.keys() | ledger.read
        for group_id, (how, number) in sorted(model.items()):
            if self.lost[(inc, group_id)]:
                raise InvariantBroken(f"{group_id} was written off as lost, and {how} by step {number} of the model")
            self._refused(ledger, group_id, f"was {how} by step {number} of the model")
        for (lost_inc, group_id), moments in sorted(self.lost.items()):
            if lost_inc == inc and moments:
                self._refused(ledger, group_id, "was written off as lost")
        for group_id, settled in sorted(ledger.settled.items()):
            if settled.fate == Fate.DEAD:
                if not self.letters[(inc, group_id)]:
                    raise InvariantBroken(f"the ledger holds {group_id} dead, but no dead letter of it was written")
            elif self.fate(inc, group_id, model) is None:
                raise InvariantBroken(f"the ledger holds {group_id} {settled.fate}; the world saw it get no fate")
        for group_id in sorted(self.fed[inc], key=feeding_order):
            if group_id in unsettled or self.fate(inc, group_id, model) is not None:
                continue
            if ledger.fate(group_id) == Fate.DEAD:
                continue  # re-injected: the ledger reopens it once it reads the record in DEAD
            if ledger.covered(group_id):
                raise InvariantBroken(
                    f"the ledger's watermark {ledger.watermark()} covers {group_id}, which the world saw get no fate"
                )
            position = feed_position(group_id)
            if position is not None and position >= t.cursor:
                continue  # fed before a resume went back: to be fed again
            raise InvariantBroken(
                f"fed group {group_id} has no fate, and the ledger has forgotten it: not in flight, not settled, not "
                f"under its watermark, and the feeder is past it"
            )

    @staticmethod
    def _refused(ledger: GroupLedger, group_id: str, why: str) -> None:
        """``group_id`` has its fate: the ledger must refuse a copy of it, now and after a purge forgets it."""
        if group_id in ledger.in_flight or group_id in ledger.read:
            raise InvariantBroken(f"{group_id} {why}, yet the ledger waits for it")
        if group_id not in ledger.settled and not ledger.covered(group_id):
            raise InvariantBroken(f"{group_id} {why}; the ledger would take a copy of it")

    def fateless(self, incarnation: str, fingerprint: int, pending: set[str]) -> list[str]:
        """The groups fed that have no fate and that nothing waits for on PROMPTS or in EXPERIENCE."""
        model = self.model(fingerprint)
        fed = sorted(self.fed[incarnation], key=feeding_order)
        return [g for g in fed if g not in pending and not self.fate(incarnation, g, model)]

    def check_final(self, incarnation: str, fingerprint: int, pending: set[str], stalled: set[str]) -> None:
        """After the drain: every group fed has exactly one fate or still waits on PROMPTS or in EXPERIENCE, and the
        feeder published every prompt up to the last it fed. ``stalled``: the groups a stalled pipeline waits for
        by design (``World.check_final``)."""
        fateless = [g for g in self.fateless(incarnation, fingerprint, pending) if g not in stalled]
        if fateless:
            raise InvariantBroken(f"fed groups without a fate: {fateless}")
        positions = {position[1] for g in self.fed[incarnation] if (position := feed_position(g)) is not None}
        skipped = sorted(set(range(max(positions, default=-1) + 1)) - positions)
        if skipped:
            raise InvariantBroken(f"the feeder went past prompts it never published: positions {skipped}")
