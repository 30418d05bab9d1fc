"""`rlpipe run` starts the rollout replicas its placement gives: `rollout.replicas: auto` on this CPU starts the one
`rlpipe plan` gives for a CPU, a count starts that many; and `rlpipe status` shows each replica's GPU memory, none
here."""

import json

import pytest

from services.cli.plan import CPU_AUTO_REPLICAS
from tests.support.runs import config_file, rlpipe, run_info, running_pipeline

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("replicas", "started"), [("auto", CPU_AUTO_REPLICAS), (2, 2)])
def test_a_run_starts_the_rollout_replicas_its_placement_gives(replicas, started, tiny_model, tmp_path):
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="placed",
        rollout={"replicas": replicas, "prompts_per_batch": 4, "backend": "hf"},
    )
    run_dir = tmp_path / "runs" / "placed"
    # Held: the replicas are counted while they wait, and the run never races its own end.
    with running_pipeline(config, "--paused") as process:
        info = run_info(run_dir, process)
        shown = rlpipe(run_dir, "status", "--json")
        assert rlpipe(run_dir, "stop").returncode == 0
        output, _ = process.communicate(timeout=600)
    assert sorted(name for name in info["pids"] if name.startswith("rollout")) == [
        f"rollout-{i}" for i in range(started)
    ]
    said = "rollout.replicas: auto without a GPU: 1 rollout replica" if replicas == "auto" else "2 rollout replica(s)"
    assert f"placement: {said}" in output
    services = json.loads(shown.stdout)["services"]
    assert {s["instance"] for s in services if s["role"] == "rollout"} == {f"rollout-{i}" for i in range(started)}
    # On a CPU no replica holds GPU memory: every figure is 0 (shown as "-" in the table), none made up.
    assert {(s["gpu_allocated_gib"], s["gpu_reserved_gib"], s["gpu_used_gib"]) for s in services} == {(0.0, 0.0, 0.0)}
