"""`rlpipe plan` and doctor's sizing row: a run config's inputs, the GPUs a plan is for, the rendered plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli.app import app
from services.cli.plan import Gpus, inputs_from_config, resolve_gpus, sizing_row
from services.cli.sizing import GIB, MIB, HostMemory, SizingInputs, estimate, gib, read_model_shape, with_headroom
from services.common.config import load_config
from tests.support.models import SMOLLM2_CONFIG, config_only
from tests.support.paths import ROOT
from tests.support.runs import config_file

pytestmark = pytest.mark.unit


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    return config_file(
        tmp_path,
        config_only(tmp_path, SMOLLM2_CONFIG),
        "run.yaml",
        model={"dtype": "bfloat16"},
        sampling={"group_size": 4, "max_new_tokens": 6},
        train={
            "algorithm": "ppo",
            "batch_size": 8,
            "mini_batches": 2,
            "grad_accum_steps": 2,
            "max_seq_len": 128,
            "micro_batch_tokens": None,
            "master_weights": "model_dtype",
            "gradient_checkpointing": True,
        },
        rollout={"prompts_per_batch": 5, "kv_cache_mib": None},
        reference={"batch": 3},
    )


def test_a_run_config_plans_its_algorithm_precision_and_batch_shape(config_path: Path) -> None:
    inputs = inputs_from_config(load_config(config_path))
    assert inputs == SizingInputs(
        algorithm="ppo",
        critic="separate",
        micro_batch_tokens=8 * 4 // (2 * 2) * 128,  # equal-count micro-batches of 8 rows, each up to 128 tokens
        max_seq_len=128,
        group_size=4,
        reference_groups=3,
        rollout_sequences=5 * 4,
        gradient_checkpointing=True,
        model_dtype="bfloat16",
        master_dtype="bfloat16",
        lora_rank=None,
        kv_cache_bytes=None,
    )


def test_a_configured_kv_cache_and_micro_batch_tokens_are_taken_as_set(tmp_path: Path, config_path: Path) -> None:
    cfg = load_config(config_path, train={"micro_batch_tokens": 512}, rollout={"kv_cache_mib": 300})
    inputs = inputs_from_config(cfg)
    assert (inputs.micro_batch_tokens, inputs.kv_cache_bytes) == (512, 300 * MIB)


def test_a_lora_config_plans_its_adapters_not_a_full_fine_tune(config_path: Path) -> None:
    full = load_config(config_path, train={"algorithm": "grpo"})
    model = {"path": str(full.model.path), "dtype": "bfloat16"}
    adapters = {"r": 8, "target_modules": ["q_proj", "v_proj"]}
    lora = load_config(config_path, train={"algorithm": "grpo"}, model={**model, "lora": adapters})
    inputs = inputs_from_config(lora)
    assert (inputs.lora_rank, inputs.lora_targets) == (8, ("q_proj", "v_proj"))
    shape = read_model_shape(lora.model.path)
    # 8 x (576 + 576 and 576 + 192) per layer of 30, against all 134.5M parameters (SmolLM2's shape).
    assert estimate(shape, inputs).trainable_parameters == 8 * (576 + 576 + 576 + 192) * 30
    assert estimate(shape, inputs_from_config(full)).trainable_parameters > 100_000_000
    # A target the estimate cannot size is a warning of the doctor's row, never a crash of the doctor.
    odd = load_config(config_path, model={**model, "lora": {"target_modules": ["lm_head"]}})
    row = sizing_row(odd, Gpus(0, 0), None)
    assert row.status == "warn" and "LoRA targets ['lm_head'] are not among a layer's projections" in row.detail


def nothing_seen() -> Gpus:
    return Gpus(0, 0)


def two_seen() -> Gpus:
    return Gpus(2, 24 * GIB)


def test_gpu_options_fill_in_from_the_gpus_this_machine_sees() -> None:
    assert resolve_gpus(None, None, two_seen) == Gpus(2, 24 * GIB)
    assert resolve_gpus(4, None, two_seen) == Gpus(4, 24 * GIB)
    assert resolve_gpus(None, 80, two_seen) == Gpus(2, 80 * GIB)
    assert resolve_gpus(None, 80, nothing_seen) == Gpus(1, 80 * GIB)
    assert resolve_gpus(0, None, two_seen) == Gpus(0, 0)
    assert resolve_gpus(8, 80, nothing_seen) == Gpus(8, 80 * GIB)


def test_a_gpu_count_without_memory_on_a_cpu_host_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match="--gpus 2 needs --gpu-memory-gib"):
        resolve_gpus(2, None, nothing_seen)


def roomy_host(available: int) -> HostMemory:
    return HostMemory(total=64 * GIB, available=available, swap_total=0, swap_free=0)


def test_doctor_row_warns_when_a_cpu_run_would_not_fit_in_host_memory(config_path: Path) -> None:
    row = sizing_row(load_config(config_path), Gpus(0, 0), roomy_host(available=GIB))
    assert row.status == "warn"
    assert "all roles on this CPU" in row.detail
    assert "available (no swap: OOM)" in row.detail


def test_doctor_row_is_ok_when_a_cpu_run_fits_the_host(config_path: Path) -> None:
    row = sizing_row(load_config(config_path), Gpus(0, 0), roomy_host(available=60 * GIB))
    assert row.status == "ok"


def test_doctor_row_names_the_first_placement_that_fits_the_gpus(config_path: Path) -> None:
    row = sizing_row(load_config(config_path), Gpus(1, 80 * GIB), None)
    assert (row.status, row.detail.split(" fits")[0]) == ("ok", "all roles on one GPU")


def test_doctor_row_warns_when_no_placement_fits_the_gpus(config_path: Path) -> None:
    row = sizing_row(load_config(config_path), Gpus(3, GIB), None)
    assert row.status == "warn"
    assert row.detail.startswith("no placement fits 3 GPU(s) of 1.00 GiB")


def test_doctor_row_warns_without_failing_when_the_model_config_lacks_a_dimension(config_path: Path) -> None:
    cfg = load_config(config_path)
    (cfg.model.path / "config.json").write_text("{}")
    row = sizing_row(cfg, Gpus(0, 0), None)
    assert (row.status, row.detail) == (
        "warn",
        f"no estimate: {cfg.model.path / 'config.json'} lacks num_hidden_layers, hidden_size, intermediate_size, "
        "num_attention_heads, vocab_size: not a decoder-only transformer rlpipe can size",
    )


def test_plan_of_a_config_prints_the_critic_and_which_placement_fits(config_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["plan", str(config_path), "--gpus", "3", "--gpu-memory-gib", "6"], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 0, result.output
    assert "critic (ppo)" in result.output
    assert "reference on its own GPU: fits on 3 GPU(s), trainer world size 1" in result.output


def test_plan_into_a_pipe_prints_every_column_whole_whatever_the_terminal_width(config_path: Path) -> None:
    # CliRunner's output is no terminal, like `rlpipe plan > plan.txt`; COLUMNS says 80, as a bare shell would.
    result = CliRunner().invoke(
        app, ["plan", str(config_path), "--gpus", "3", "--gpu-memory-gib", "6"], env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "weights" in line)
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == [
        "role", "weights", "gradients", "optimizer", "activations", "logits / KV cache", "total", "+25%"
    ]  # fmt: skip
    assert "…" not in result.output


def test_plan_json_holds_the_estimate_headroom_and_placements(config_path: Path) -> None:
    result = CliRunner().invoke(app, ["plan", str(config_path), "--gpus", "3", "--gpu-memory-gib", "6", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["with_headroom"] == {role: with_headroom(total) for role, total in plan["totals"].items()}
    assert plan["totals"]["trainer"] > plan["estimate"]["trainer"]["weights"] > 0
    assert plan["gpus"] == {"count": 3, "memory": 6 * 2**30}
    assert "reference on its own GPU" in [layout["name"] for layout in plan["placements"]]


def test_plan_of_a_folder_without_config_json_exits_2_naming_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["plan", str(tmp_path), "--gpus", "0"])
    assert result.exit_code == 2
    assert f"cannot read a model shape from {tmp_path / 'config.json'}" in result.output


@pytest.mark.integration
def test_rlpipe_plan_on_the_tiny_model_folder_prints_each_roles_estimate(tiny_model: tuple[Path, Path]) -> None:
    model_dir, _ = tiny_model
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "plan", str(model_dir), "--gpus", "0", "--seq-len", "64"],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    est = estimate(read_model_shape(model_dir), SizingInputs(max_seq_len=64))
    assert "0.6M parameters (3 layers, hidden 128, 4 heads / 2 kv, vocab 43)" in done.stdout
    trainer_row = next(line for line in done.stdout.splitlines() if "trainer (1 rank)" in line)
    cells = [cell.strip() for cell in trainer_row.split("│")[1:-1]]
    assert cells == [
        "trainer (1 rank)",
        gib(est.trainer.weights),
        gib(est.trainer.gradients),
        gib(est.trainer.optimizer),
        f"{gib(est.trainer.activations)} (without checkpointing)",
        gib(est.trainer.logits),
        gib(est.trainer.total),
        gib(int(est.trainer.total * 1.25)),
    ]
    every_role = est.trainer.total + est.reference.total + est.rollout.total + est.rollout.weights  # vLLM CPU: 2 copies
    assert f"every role on this CPU needs {gib(int(every_role * 1.25))}" in done.stdout
