"""The recovery simulation (tests/trainer/simulation.py, docs/testing.md): seeded scenarios of feeds, deliveries,
crashes, rollbacks, prunes, store, mirror and broker outages, bitrot, lost broker writes, lease takeovers and restarts
against the real intake, ledger, lineage, checkpoint store, recovery and lease, each held after every op against the
oracle's own record of what became of every group, and against the lineage for its weights.

Replay one seed: ``pytest tests/trainer/test_simulation.py -k every_fed_group --sim-seed N``; run more:
``--sim-scenarios 20000``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from services.trainer.checkpointing.retention import Purger
from services.trainer.checkpointing.step_store import StepStore
from services.trainer.intake.ledger import Fate, GroupLedger
from tests.trainer.sim_oracle import InvariantBroken
from tests.trainer.sim_scenario import FOUND_HOLES, Features, Op, describe, draw_scenario
from tests.trainer.simulation import run_ops, run_scenario, sim_config

pytestmark = pytest.mark.unit


@pytest.fixture
def one_thread():
    """Torch's intra-op threads only fight over the cores for the simulation's tiny tensors."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def replay_command(seed: int) -> str:
    return f"pytest tests/trainer/test_simulation.py -k every_fed_group --sim-seed {seed}"


def test_every_fed_group_keeps_exactly_one_fate_and_the_weights_follow_the_lineage_in_every_seeded_scenario(
    tmp_path, request, one_thread
):
    chosen = request.config.getoption("--sim-seed")
    seeds = [chosen] if chosen is not None else range(request.config.getoption("--sim-scenarios"))
    cfg = sim_config(tmp_path)
    outcomes: Counter[str] = Counter()
    for seed in seeds:
        try:
            outcomes += run_scenario(cfg, seed)
        except InvariantBroken as broken:
            pytest.fail(f"{describe(seed, draw_scenario(seed))}\n{broken}\nreplay: {replay_command(seed)}")
    # How long the default 1,000 take is a figure for docs/testing.md, not an assertion: speed belongs in bench/.
    if chosen is None and request.config.getoption("--sim-scenarios") == 1000:
        # Not vacuous: the default run reaches every kind of trouble it draws.
        for outcome in (
            "steps applied",
            "resume",
            "rollback",
            "restart",
            "crashed mid-effect",
            "start refused",
            "groups lost",
            "groups filtered",
            "dead letters",
            "reinjected",
            "groups reopened",
            "zombie fenced out",
            "objects rotted",
            "checkpoints read from the mirror",
            "experience lost by the broker",
            "broker state lost",
            "ended stalled on lost groups",
        ):
            assert outcomes[outcome] > 0, f"no scenario had {outcome}: {dict(outcomes)}"


@pytest.mark.parametrize("hole", sorted(FOUND_HOLES))
def test_a_hole_the_simulation_found_stays_closed(hole, tmp_path):
    seed, length, features = FOUND_HOLES[hole]
    run_scenario(sim_config(tmp_path), seed, length=length, features=features)  # as it was found


def test_a_resume_after_a_rollback_the_mirror_missed_loads_no_abandoned_step(tmp_path):
    """Written out, not drawn: a rollback while the mirror is down leaves the abandoned steps live there; a crash
    and a resume before the new branch overtakes them must not adopt one (the oracle compares the weights with the
    lineage's steps)."""
    ops = [Op("deliver"), Op("step")] * 8
    ops += [Op("mirror_down", 2), Op("rollback", 0), Op("crash", 0), Op("mirror_down", 0), Op("step")]
    outcomes = run_ops(sim_config(tmp_path), 0, ops, Features(loop=True, mirror=True))
    assert (outcomes["rollback"], outcomes["resume"]) == (1, 1)


def test_a_scenario_replays_the_same_way_every_time(tmp_path):
    cfg = sim_config(tmp_path)
    assert run_scenario(cfg, 7) == run_scenario(cfg, 7)


# -- planted bugs: the checks can fail -------------------------------------------------------------------------------

REAL_ADVANCE, REAL_REWIND, REAL_RESTORE = GroupLedger.advance, GroupLedger.rewind, GroupLedger.restore


def advance_past_groups_in_flight(self: GroupLedger) -> None:
    """The watermark moved as if no group were in flight: it passes groups that have no fate yet."""
    in_flight, self.in_flight = self.in_flight, {}
    try:
        REAL_ADVANCE(self)
    finally:
        self.in_flight = in_flight


def rewind_reopening_nothing(self: GroupLedger, *args: Any, **kwargs: Any) -> list[str]:
    """A rollback that reopens nothing: the groups the abandoned steps settled lose that fate, and are not in
    flight either."""
    for group_id in REAL_REWIND(self, *args, **kwargs):
        del self.in_flight[group_id]
    return []


def restore_forgetting_what_was_applied(self: GroupLedger, *args: Any, **kwargs: Any) -> None:
    """A resume that forgets which groups its checkpoint settled (all but the dead ones) and its watermark: a copy
    of a group the model already holds would be applied again after the crash."""
    REAL_RESTORE(self, *args, **kwargs)
    self.settled = {g: settled for g, settled in self.settled.items() if settled.fate == Fate.DEAD}
    self.settled_through = None


async def read_on_after_ignoring_the_purge(self: Purger, seq: int) -> int:
    """A resume or rollback reads EXPERIENCE on from its checkpoint's sequence even where the run purged it: the
    trainer meets a gap the broker never made, which the world knows."""
    return seq


def check_fence_without_reading_it(self: StepStore) -> None:
    """A store write checked against the writer's own lease only, not against the fence a successor claimed."""
    if self.guard is not None:
        self.guard()


# Each bug, planted in the real component, with the seeds it is looked for in: the run stops at the first that
# catches it (seeds 10, 0, 3, 3 and 154 when this was written; the purge bug also at 159 and 287 of 0..399, so it is
# looked for near them only), and the budget costs time only if the checks went blind.
PLANTED: dict[str, tuple[type, str, Callable[..., Any], range]] = {
    "watermark": (GroupLedger, "advance", advance_past_groups_in_flight, range(60)),
    "rollback": (GroupLedger, "rewind", rewind_reopening_nothing, range(30)),
    "resume": (GroupLedger, "restore", restore_forgetting_what_was_applied, range(30)),
    "fence": (StepStore, "_check_fence", check_fence_without_reading_it, range(30)),
    "purge": (Purger, "read_on_after", read_on_after_ignoring_the_purge, range(150, 160)),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_a_planted_bug_is_caught_within_the_seeds_it_is_looked_for_in(bug, tmp_path, monkeypatch, one_thread):
    owner, name, buggy, seeds = PLANTED[bug]
    monkeypatch.setattr(owner, name, buggy)
    cfg = sim_config(tmp_path)
    for seed in seeds:
        try:
            run_scenario(cfg, seed)
        except InvariantBroken:
            return
    pytest.fail(
        f"no seed of {seeds.start}..{seeds.stop - 1} caught the planted bug ({buggy.__doc__}): the checks went blind "
        f"to it, or the scenarios changed and its catching seeds moved out of the range. Replay: "
        f"pytest tests/trainer/test_simulation.py -k 'planted and {bug}'"
    )
