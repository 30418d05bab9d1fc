"""The "one GPU shared" placement: the plan's arithmetic by hand, the shares' validation, and what the launcher
starts each role with (services/cli/sizing.py shared_gpu, services/cli/launch/placement.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli.app import app
from services.cli.launch.credentials import RunCredentials
from services.cli.launch.launcher import Launcher
from services.cli.launch.placement import RunPlacement, decide_placement, gpu_memory, shared_device
from services.cli.plan import CPU_AUTO_REPLICAS, shared_gpu_line
from services.cli.sizing import GIB, ModelShape, RoleMemory, SizingEstimate, SizingInputs, TrainerMemory, gpu_share
from services.cli.sizing import shared_gpu as plan_shared_gpu
from services.common.config import ConfigError, load_config
from services.common.model.gpu_share import ALLOCATOR_FLOOR_BYTES, allocator_fraction
from services.common.transport.nats_auth import write_run_credentials
from services.common.transport.nats_connect import SERVICE_ROLES
from tests.support.hardware import GPU_A, GPU_B
from tests.support.models import SMOLLM2_CONFIG, config_only
from tests.support.runs import config_file

pytestmark = pytest.mark.unit

SHAPE = ModelShape(layers=2, hidden=4, intermediate=8, heads=2, kv_heads=1, vocab=10, tied_embeddings=True, head_dim=2)


def estimate_of(trainer_gib: float, reference_gib: float, rollout_gib: float) -> SizingEstimate:
    """An estimate whose roles need these totals (the split inside a role does not matter to the placement)."""
    trainer = TrainerMemory(int(trainer_gib * GIB), 0, 0, 0, 0, 0, 0, 0)
    reference, rollout = RoleMemory(int(reference_gib * GIB), 0), RoleMemory(int(rollout_gib * GIB), 0)
    return SizingEstimate(SHAPE, SizingInputs(), 0, trainer, reference, rollout)


# On 80 GiB (a thousandth is 0.08 GiB), with 25% headroom, the allocator's 0.25 GiB floor and a 0.5 GiB CUDA context
# each: the trainer (6 GiB) 7.5 + 0.75 = 8.25 GiB = 0.1031, up to 0.104; the reference (1.2 GiB) 1.5 + 0.75 = 2.25 GiB
# = 0.0281, up to 0.029; a rollout (2 GiB) 2.5 + 0.75 = 3.25 GiB = 0.0406, up to 0.041.
EIGHTY = 80 * GIB
EST = estimate_of(6, 1.2, 2)


def test_a_process_share_is_its_need_with_headroom_an_allocator_floor_and_a_cuda_context_rounded_up_to_a_thousandth():
    assert gpu_share(int(5.8 * GIB), EIGHTY) == 0.1  # 7.25 + 0.75 = 8 GiB, exactly a thousandth: not pushed up
    assert gpu_share(int(6 * GIB), EIGHTY) == 0.104
    assert gpu_share(int(2 * GIB), EIGHTY) == 0.041
    assert gpu_share(int(1.2 * GIB), EIGHTY) == 0.029


def test_a_tiny_models_share_leaves_its_allocator_at_least_the_floor_on_a_large_gpu():
    """The tiny model's roles on an H200 got 0.004 (575 MiB), an allocator cap of 63 MiB after the context: under
    cuBLAS's 32 MiB workspace and the allocator's 20 MiB segments beside the model."""
    h200 = 143_771 * 2**20
    for need in (1, 24 * 2**20, 42 * 2**20):
        assert allocator_fraction(gpu_share(need, h200), h200, "trainer") * h200 >= ALLOCATOR_FLOOR_BYTES


def test_the_rollout_replicas_that_fit_are_what_the_trainer_and_reference_leave_over_one_rollouts_share():
    plan = plan_shared_gpu(EST, EIGHTY, max_replicas=100)
    assert plan.shares == {"trainer": 0.104, "reference": 0.029, "rollout": 0.041}
    assert plan.fitting == plan.rollout_replicas == 21  # (1 - 0.104 - 0.029) / 0.041 = 21.1
    assert plan.claimed == pytest.approx(0.104 + 0.029 + 21 * 0.041)


def test_auto_starts_at_most_its_maximum_however_many_fit():
    plan = plan_shared_gpu(EST, EIGHTY, max_replicas=4)
    assert (plan.fitting, plan.rollout_replicas) == (21, 4)


def test_shares_the_config_gives_win_over_the_plans_and_reference_and_reward_replicas_take_their_room():
    plan = plan_shared_gpu(EST, EIGHTY, given={"trainer": 0.5}, max_replicas=100)
    assert plan.shares["trainer"] == 0.5 and plan.given == ("trainer",)
    assert plan.fitting == 11  # (1 - 0.5 - 0.029) / 0.041 = 11.5
    assert plan_shared_gpu(EST, EIGHTY, reference_replicas=2, max_replicas=100).fitting == 20  # 0.838 / 0.041
    reward = plan_shared_gpu(EST, EIGHTY, given={"reward": 0.1}, reward_replicas=2, max_replicas=100)
    assert (reward.reserved, reward.fitting) == (0.2, 16)  # 0.667 / 0.041 = 16.3


def test_a_gpu_the_trainer_alone_overflows_fits_no_rollout_replica():
    plan = plan_shared_gpu(EST, 4 * GIB)
    assert plan.shares["trainer"] == 2.063 and (plan.fitting, plan.fits) == (0, False)
    assert shared_gpu_line(plan).startswith("one GPU shared: does not fit: the trainer and reference leave no room")


def test_the_plan_line_names_the_replicas_and_each_roles_share_and_memory():
    line = shared_gpu_line(plan_shared_gpu(EST, EIGHTY, given={"trainer": 0.1}))
    assert line.startswith("one GPU shared: trainer + reference + 4 rollout replica(s): fits")
    assert "trainer 0.100 = 8.00 GiB (set), reference 0.029 = 2.32 GiB each, rollout 0.041 = 3.28 GiB each" in line
    assert "21 rollout replica(s) fit, rollout.replicas: auto starts 4" in line


@pytest.fixture
def run_config(tmp_path: Path):
    """A run config writer for SmolLM2's shape: ``run_config(**sections)`` -> its path."""
    folders = config_only(tmp_path, SMOLLM2_CONFIG)

    def write(**sections: dict) -> Path:
        return config_file(tmp_path, folders, "run.yaml", **sections)

    return write


def test_rlpipe_plan_of_a_config_prints_the_shared_gpu_line_with_the_configs_shares(run_config):
    config = run_config(service={"gpu_memory_fraction": {"trainer": 0.3}}, rollout={"replicas": "auto"})
    result = CliRunner().invoke(app, ["plan", str(config), "--gpus", "1", "--gpu-memory-gib", "80"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "one GPU shared" in line)
    assert "trainer 0.300 = 24.00 GiB (set)" in line and "auto starts 4" in line
    cpu = CliRunner().invoke(app, ["plan", str(config), "--gpus", "0", "--json"])
    assert json.loads(cpu.output)["auto_rollout_replicas"] == CPU_AUTO_REPLICAS == 1


def test_shares_of_one_gpu_that_sum_past_all_of_it_are_refused_naming_the_field(run_config):
    config = run_config(
        service={"gpu_memory_fraction": {"trainer": 0.5, "rollout": 0.2}}, rollout={"replicas": 3, "backend": "hf"}
    )
    with pytest.raises(ConfigError, match=r"service.gpu_memory_fraction: .* 1.100 of its memory \(trainer 0.5 x 1"):
        load_config(config)
    with pytest.raises(
        ConfigError, match=re.escape("service.gpu_memory_fraction: a share of a GPU's memory is above 0")
    ):
        load_config(run_config(service={"gpu_memory_fraction": {"reference": 1.5}}))


def test_a_vllm_rollouts_share_replaces_its_gpu_memory_utilization_and_survives_a_reload(run_config):
    from services.common.config import apply_overrides

    cfg = load_config(
        run_config(service={"gpu_memory_fraction": {"rollout": 0.2}}, rollout={"gpu_memory_utilization": 0.5})
    )
    assert cfg.rollout.gpu_memory_utilization == 0.2  # what vllm_engine_args gives the engine
    # A restart-only change of the share, applied over the whole dumped config, moves vLLM's setting with it.
    changed = apply_overrides(cfg, {"service.gpu_memory_fraction": {"rollout": 0.3}})
    assert changed.rollout.gpu_memory_utilization == 0.3


def test_auto_replicas_with_a_trainer_on_several_gpus_or_a_sharded_engine_is_refused_naming_the_field(run_config):
    with pytest.raises(
        ConfigError, match=re.escape("rollout.replicas: auto places every role on one GPU, and trainer.nproc 2")
    ):
        load_config(run_config(rollout={"replicas": "auto"}, trainer={"nproc": 2}))
    with pytest.raises(ConfigError, match=re.escape("rollout.replicas: 0 rollout replicas: at least 1, or auto")):
        load_config(run_config(rollout={"replicas": 0}))


def test_a_count_of_replicas_starts_that_many_and_changes_nothing_else(run_config):
    cfg = load_config(run_config(rollout={"replicas": 3}))
    placement = decide_placement(cfg, None, None, None)
    assert placement.rollout_replicas == 3 and placement.env() == {}


def test_auto_without_a_gpu_starts_one_replica_and_tells_the_roles_the_count(run_config):
    cfg = load_config(run_config(rollout={"replicas": "auto"}))
    placement = decide_placement(cfg, EST, None, None)
    assert placement.rollout_replicas == 1
    assert placement.env() == {"RLPIPE_ROLLOUT__REPLICAS": "1"}  # no GPU to name, no shares to cap


def test_auto_on_a_gpu_starts_the_plans_replicas_on_the_first_visible_gpu_each_role_with_its_share(run_config):
    cfg = load_config(
        run_config(rollout={"replicas": "auto", "backend": "hf"}, service={"gpu_memory_fraction": {"reward": 0.05}})
    )
    placement = decide_placement(cfg, EST, EIGHTY, "3,5")
    # The reward's 0.05 comes off first: (1 - 0.05 - 0.104 - 0.029) / 0.041 = 19.9, of which auto starts 4.
    assert placement.rollout_replicas == 4 and "4 rollout replica(s) of the 19 that fit" in placement.summary
    shares = {"trainer": 0.104, "reference": 0.029, "rollout": 0.041, "reward": 0.05}
    assert placement.env() == {
        "RLPIPE_ROLLOUT__REPLICAS": "4",
        "RLPIPE_SERVICE__GPU_MEMORY_FRACTION": json.dumps(shares, sort_keys=True),
        "CUDA_VISIBLE_DEVICES": "3",
    }


def test_a_role_started_with_the_placements_environment_loads_a_config_whose_shares_fit(run_config, monkeypatch):
    config = run_config(rollout={"replicas": "auto"}, service={"gpu_memory_fraction": {"trainer": 0.5}})
    placement = decide_placement(load_config(config), EST, EIGHTY, None)
    for name, value in placement.env().items():
        monkeypatch.setenv(name, value)
    cfg = load_config(config)  # as the role loads it: the environment over the file
    assert cfg.rollout.replicas == placement.rollout_replicas == 4
    assert cfg.service.gpu_memory_fraction == {"trainer": 0.5, "reference": 0.029, "rollout": 0.041}
    assert cfg.rollout.gpu_memory_utilization == 0.041  # the vLLM rollout's share


def test_auto_with_no_room_for_one_rollout_refuses_to_start_naming_the_field(run_config):
    cfg = load_config(run_config(rollout={"replicas": "auto"}))
    with pytest.raises(ConfigError, match=re.escape("rollout.replicas: auto found no room for one rollout replica")):
        decide_placement(cfg, EST, 4 * GIB, None)


def test_every_role_and_its_restarts_get_the_placements_gpu_and_shares(run_config, tmp_path):
    placement = RunPlacement(2, "two", {"trainer": 0.4, "rollout": 0.2}, "0", decided=True)
    launcher = Launcher(load_config(run_config(rollout={"backend": "hf"})), tmp_path, resume=False, placement=placement)
    launcher.credentials = RunCredentials(tmp_path, nats_keys=write_run_credentials(tmp_path / "nats-auth"))
    for role in SERVICE_ROLES:  # role_env is what spawn gives a role, at its start and at each restart
        given = launcher.role_env(role)
        assert {name: given[name] for name in placement.env()} == placement.env(), role


def test_the_shared_gpu_is_the_first_the_launcher_sees():
    assert (shared_device(None), shared_device("2"), shared_device(" 3 ,1")) == ("0", "2", "3")
    assert shared_device(f"{GPU_B.uuid},0") == GPU_B.uuid


def test_the_shared_gpus_memory_comes_from_nvml_by_index_or_uuid_else_from_torch(fake_nvml):
    never = lambda: pytest.fail("torch asked although NVML answered")  # noqa: E731
    assert gpu_memory(None, fake_nvml, never) == GPU_A.mem_total_bytes
    assert gpu_memory("1", fake_nvml, never) == GPU_B.mem_total_bytes
    assert gpu_memory(GPU_B.uuid, fake_nvml, never) == GPU_B.mem_total_bytes
    assert gpu_memory("", fake_nvml, never) is None  # CUDA_VISIBLE_DEVICES="" hides every GPU
    assert gpu_memory("7", fake_nvml, lambda: None) is None  # NVML has no GPU 7, and torch sees none
    assert gpu_memory("0", None, lambda: 24 * GIB) == 24 * GIB  # no NVML: torch's word
