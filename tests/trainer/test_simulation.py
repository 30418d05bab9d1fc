"""The recovery simulation (tests/trainer/simulation.py, docs/testing.md): seeded scenarios of feeds, deliveries,
crashes, rollbacks, prunes, store and broker outages and restarts against the real intake, ledger, lineage,
checkpoint store and recovery, the invariants checked after every op.

Replay one seed: ``pytest tests/trainer/test_simulation.py --sim-seed N``; run more: ``--sim-scenarios 20000``."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.trainer.simulation import FOUND_HOLES, InvariantBroken, describe, draw_scenario, run_scenario, sim_config

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


def test_every_fed_group_keeps_exactly_one_fate_and_policy_versions_only_grow_in_every_seeded_scenario(
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
            "groups lost",
            "reinjected",
            "groups reopened",
        ):
            assert outcomes[outcome] > 0, f"no scenario had {outcome}: {dict(outcomes)}"
        assert outcomes["dead letters"] > 0 and outcomes["start refused"] > 0, dict(outcomes)


@pytest.mark.parametrize("hole", sorted(FOUND_HOLES))
def test_a_hole_the_simulation_found_stays_closed(hole, tmp_path):
    seed, length, reinjects = FOUND_HOLES[hole]
    run_scenario(sim_config(tmp_path), seed, length=length, reinjects=reinjects)  # as it was found


def test_a_scenario_replays_the_same_way_every_time(tmp_path):
    cfg = sim_config(tmp_path)
    assert run_scenario(cfg, 7) == run_scenario(cfg, 7)
