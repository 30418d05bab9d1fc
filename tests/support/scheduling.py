"""The order in which one session of all three tiers hands files to pytest-xdist workers (`make test`: ``--dist
loadfile --no-loadscope-reorder``, a whole file at a time in collection order; docs/testing.md measures why)."""

from __future__ import annotations

import pytest

from tests.support.tiers import tier_of

# The files that take longest, longest first (wall seconds on 3 workers, docs/testing.md; the SmolLM2 file imports
# its model on a fresh clone). The longest started first leave short files to fill the end, where a long one last
# would run on one core while the others idle. The unit tier's own longest file (30 to 43 s, a thousand simulated
# scenarios) leads the unit tier for the same reason; the other tiers deselect it.
LONGEST_FIRST = (
    "tests/trainer/test_simulation.py",
    "tests/trainer/test_algorithms_pipeline.py",
    "tests/test_examples.py",
    "tests/cli/verify/test_checklist.py",
    "tests/trainer/learning/test_distributed.py",
    "tests/test_storage_outage.py",
    "tests/test_exactly_once.py",
    "tests/test_chaos.py",
    "tests/test_admin.py",
    "tests/tuner/test_shared_study.py",
    "tests/rollout/test_smol_sync.py",
    "tests/tuner/test_tune.py",
    "tests/trainer/learning/test_learner.py",
    "tests/common/test_datasets.py",
    "tests/cli/doctor/test_checks.py",
    "tests/test_pipeline.py",
    "tests/cli/launch/test_launcher.py",
    "tests/test_overrides.py",
    "tests/trainer/learning/test_distributed_launch.py",
    "tests/reward/test_reward_pipeline.py",
    "tests/test_recovery.py",
)
# Files that mostly wait (on timeouts, breakers, stopped processes: under a fifth of their wall time on a core),
# handed out next, while the other workers' runs keep both cores busy. Last in the queue they would be the last
# minutes of the session, with the cores idle meanwhile.
WAITING = (
    "tests/test_stalls.py",
    "tests/common/test_bus_faults.py",
    "tests/reward/test_remote.py",
    "tests/rollout/test_torn_sync.py",
    "tests/trainer/test_trainer_health.py",
    "tests/common/test_nats_auth.py",
    "tests/rollout/test_engine_outage.py",
    "tests/reward/test_service.py",
    "tests/common/test_presence.py",
)


def scheduling_rank(item: pytest.Item) -> tuple[int, int]:
    """Where ``item``'s file goes in the run: the listed longest files first, then the files that mostly wait, then
    the other files by tier, whole runs (e2e) first and the in-process unit files last, where they fill the cores
    while the last long files finish; a stable sort keeps each file's tests in their order."""
    path = item.nodeid.partition("::")[0]
    if path in LONGEST_FIRST:
        return (0, LONGEST_FIRST.index(path))
    if path in WAITING:
        return (1, WAITING.index(path))
    return (2, ("e2e", "integration", "unit").index(tier_of(item)))


@pytest.hookimpl(trylast=True)  # after tiers.py has refused untiered tests and deselected the tiers not asked for
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=scheduling_rank)
