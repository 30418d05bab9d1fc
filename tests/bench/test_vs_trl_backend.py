"""``python -m bench.vs_trl --backend``: which generation engine each system is handed (no bench is run)."""

import pytest

from bench.trl_worker import trl_generation
from bench.vs_trl import TASKS, Task, arguments, rlpipe_config, task_from

pytestmark = pytest.mark.unit


def test_backend_vllm_gives_rlpipe_its_vllm_rollout_and_trl_its_colocated_vllm(tmp_path):
    task = Task(backend="vllm")
    assert rlpipe_config(task, tmp_path)["rollout"]["backend"] == "vllm"
    assert trl_generation(task) == {"use_vllm": True, "vllm_mode": "colocate"}
    hf = Task(backend="hf")
    assert (rlpipe_config(hf, tmp_path)["rollout"]["backend"], trl_generation(hf)) == ("hf", {})


def test_without_a_backend_each_system_keeps_its_own_engine(tmp_path):
    smol = TASKS["smol"]
    assert smol.backend == ""
    assert rlpipe_config(smol, tmp_path)["rollout"]["backend"] == "vllm"  # examples/smol-arith.yaml's
    assert trl_generation(smol) == {}  # TRL's transformers generate


def test_the_command_line_backend_reaches_the_task_both_systems_get():
    task = task_from(arguments().parse_args(["--task", "smol", "--backend", "vllm", "--steps", "6"]))
    assert (task.name, task.backend, task.steps) == ("smol", "vllm", 6)
    assert task_from(arguments().parse_args(["--task", "smol"])).backend == ""
