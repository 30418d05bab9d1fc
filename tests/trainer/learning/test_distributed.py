"""The trainer sharded over two processes (torchrun, gloo, FSDP2) takes the steps one process takes.

Every run goes through tests/trainer/learning/dist_worker.py: a single process in this one, two under
``python -m torch.distributed.run`` (real processes, a real process group). Checkpoints go through
the real CheckpointStore, so a step saved by two processes is resumed by two and by one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
import yaml
from safetensors.torch import load_file

from services.common.config import load_config
from services.common.model.datasets import load_jsonl
from services.common.transport.messages import ExperienceGroup, decode, encode
from services.common.transport.storage import FileStore
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.learning.batch import Batch
from services.trainer.learning.distributed import Mesh
from services.trainer.learning.passes import rank_passes
from tests.support.paths import ROOT
from tests.support.runs import config_file
from tests.support.trainer import experience
from tests.trainer.learning import dist_worker

pytestmark = pytest.mark.integration

STEPS, SAVE_AT = 4, 2
TOLERANCE = {"atol": 1e-5, "rtol": 0.0}
TORCHRUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory) -> tuple[Path, Path, Path]:
    """A config (several optimizer steps per trainer step, micro-batches cut by tokens, pi_old recomputed, so every
    path that splits rows is taken) and fixed experience groups."""
    _, data_dir = tiny_model
    tmp = tmp_path_factory.mktemp("distributed")
    config = config_file(
        tmp,
        tiny_model,
        "config.yaml",
        train={
            "algorithm": "grpo",
            # The runs differ only in summation order (~1e-7 in a gradient); each step carries that difference on in
            # proportion to how far it moves the weights, so the rate is small enough for four steps to stay well
            # within TOLERANCE.
            "learning_rate": 2e-4,
            "warmup_steps": 1,
            "mini_batches": 2,
            "epochs": 1,
            "max_seq_len": 16,
            # Sequences of 9 and 10 tokens: 2 of 10 or 3 of 9 per micro-batch, so when scoring the batch the rank
            # with the 9-token rows has one micro-batch fewer and runs a pass that does not count.
            "micro_batch_tokens": 27,
            "old_logprobs": "recompute",
            "kl": {"coef": 0.05, "placement": "loss"},
            "off_policy": {"correction": "tis"},
        },
    )
    cfg = load_config(config)
    groups = experience(cfg, load_jsonl(data_dir / "train.jsonl")[:6])
    groups_file = tmp / "groups.msgpack"
    groups_file.write_bytes(msgpack.packb([encode(g) for g in groups], use_bin_type=True))
    return tmp, config, groups_file


def alone(setup, name: str, *options: str) -> Path:
    return worker(setup, name, [], *options)


def torchrun(setup, name: str, *options: str, nproc: int = 2) -> Path:
    # --standalone: a free port on localhost, so tests running side by side do not collide.
    return worker(
        setup, name, ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)], *options
    )


def worker(setup, name: str, launcher: list[str], *options: str) -> Path:
    """dist_worker.py in processes of its own, alone or under torchrun, each on one thread, so that how the
    single process sums its matrix products does not depend on how many cores the machine running the test has."""
    tmp, config, groups = setup
    out = tmp / name
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [
            sys.executable,
            *launcher,
            str(Path(dist_worker.__file__)),
            *("--config", str(config), "--groups", str(groups), "--out", str(out), "--steps", str(STEPS)),
            *options,
        ],
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=TORCHRUN_TIMEOUT_S,
    )
    # torchrun interleaves the ranks' output: the first rank to fail says why, the others only that it went.
    first_error = next((line for line in done.stderr.splitlines() if "Error" in line), "")
    assert done.returncode == 0, f"first error: {first_error}\n" + done.stdout[-3000:] + done.stderr[-6000:]
    return out


def run_of(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def assert_same_steps(got: Path, want: Path, steps: range) -> None:
    got_run, want_run = run_of(got), run_of(want)
    for step in steps:
        got_row, want_row = got_run["steps"][str(step)], want_run["steps"][str(step)]
        assert got_row.keys() == want_row.keys()
        for name, value in want_row.items():
            # Losses and statistics: within 1e-5. grad_norm (of order 10) sums the squares of half a million
            # gradient entries, in another order on each side: 1e-4 relative.
            rel = 1e-4 if name == "grad_norm" else 0.0
            assert got_row[name] == pytest.approx(value, abs=TOLERANCE["atol"], rel=rel), (step, name)
    assert got_run["steps_done"] == want_run["steps_done"] == STEPS
    got_model, want_model = load_file(str(got / "model.safetensors")), load_file(str(want / "model.safetensors"))
    assert got_model.keys() == want_model.keys()
    for name, tensor in want_model.items():
        torch.testing.assert_close(got_model[name], tensor, **TOLERANCE, msg=name)


@pytest.fixture(scope="module")
def runs(setup) -> dict[str, Path]:
    """One process from scratch, two from scratch, both saving at SAVE_AT; two resuming the two-process save."""
    tmp = setup[0]
    store_one, store_two = tmp / "store-one", tmp / "store-two"
    return {
        "one": alone(setup, "one", "--store", str(store_one), "--save-at", str(SAVE_AT)),
        "two": torchrun(setup, "two", "--store", str(store_two), "--save-at", str(SAVE_AT)),
        "two_resumed": torchrun(setup, "two-resumed", "--store", str(store_two), "--resume", str(SAVE_AT)),
        "store_one": store_one,
        "store_two": store_two,
    }


def test_two_processes_take_the_steps_of_one(tiny_model, runs):
    assert_same_steps(runs["two"], runs["one"], range(1, STEPS + 1))
    # The policy moved: equal weights are not just the untouched starting point.
    base = load_file(str(tiny_model[0] / "model.safetensors"))
    final = load_file(str(runs["one"] / "model.safetensors"))
    assert (final["model.embed_tokens.weight"] - base["model.embed_tokens.weight"]).abs().max() > 1e-3


def test_two_processes_take_the_steps_of_one_on_ppo_episodes_with_inserted_tokens(setup):
    """Multi-turn trajectories (three inserted tokens masked out of every completion) under PPO, whose critic is
    sharded too and whose values and GAE must skip the inserted tokens: the loss masks travel to every rank and the
    sharded steps (policy and value losses alike) match one process's. GRPO's sharded steps are the tests above."""
    tmp, config, _ = setup
    cfg = load_config(config)
    groups = experience(cfg, load_jsonl(cfg.data.train_path)[:6], observation=[11, 12, 13])
    masked = tmp / "masked-groups.msgpack"
    masked.write_bytes(msgpack.packb([encode(g) for g in groups], use_bin_type=True))
    # On these groups the gradient steepens fast (a norm near 140 by the fourth step at the shared 2e-4, which lets
    # the summation-order difference grow to 1e-4 in the loss): at half the rate it stays near 1e-6, as on one turn.
    slower = yaml.safe_load(config.read_text())
    slower["train"]["learning_rate"] = 1e-4
    slower["train"]["algorithm"] = "ppo"
    masked_config = tmp / "masked-config.yaml"
    masked_config.write_text(yaml.safe_dump(slower))
    masked_setup = (tmp, masked_config, masked)
    two = torchrun(masked_setup, "two-masked", "--store", str(tmp / "store-two-masked"))
    one = alone(masked_setup, "one-masked", "--store", str(tmp / "store-one-masked"))
    assert_same_steps(two, one, range(1, STEPS + 1))
    assert {"pg_loss", "value_loss", "explained_variance"} <= run_of(one)["steps"]["1"].keys()  # the critic trained


def test_weight_sync_serves_the_gathered_full_weights_under_every_name(runs):
    two, one = run_of(runs["two"]), run_of(runs["one"])
    assert two["snapshot_names"] == one["snapshot_names"]
    assert "lm_head.weight" in two["snapshot_names"]  # the tied alias, as vLLM wants it
    snapshot = load_file(str(runs["two"] / "snapshot.safetensors"))
    model = load_file(str(runs["one"] / "model.safetensors"))
    torch.testing.assert_close(snapshot["lm_head.weight"], snapshot["model.embed_tokens.weight"], atol=0, rtol=0)
    for name, tensor in model.items():
        torch.testing.assert_close(snapshot[name], tensor, **TOLERANCE, msg=name)
    assert two["eval_accuracy"] == one["eval_accuracy"]


def test_a_two_process_checkpoint_is_the_one_process_format_with_the_same_contents(runs):
    one = CheckpointStore(FileStore(runs["store_one"]), "dist", keep_last=10).load(SAVE_AT)
    two = CheckpointStore(FileStore(runs["store_two"]), "dist", keep_last=10).load(SAVE_AT)
    assert two.model.keys() == one.model.keys()
    for name, tensor in one.model.items():
        torch.testing.assert_close(two.model[name], tensor, **TOLERANCE, msg=name)
    assert two.optimizer["param_groups"] == one.optimizer["param_groups"]
    assert two.optimizer["state"].keys() == one.optimizer["state"].keys()
    for index, entry in one.optimizer["state"].items():
        assert two.optimizer["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(two.optimizer["state"][index][key], value, **TOLERANCE, msg=f"{index}.{key}")
    assert two.scheduler == one.scheduler
    assert torch.equal(two.rng["minibatch_order"], one.rng["minibatch_order"])


def test_two_processes_resume_a_two_process_checkpoint_and_go_on_as_one_process_did(runs):
    assert_same_steps(runs["two_resumed"], runs["one"], range(SAVE_AT + 1, STEPS + 1))


def test_one_process_resumes_a_two_process_checkpoint(setup, runs):
    resumed = alone(setup, "one-from-two", "--store", str(runs["store_two"]), "--resume", str(SAVE_AT))
    assert_same_steps(resumed, runs["one"], range(SAVE_AT + 1, STEPS + 1))


def test_two_processes_train_lora_adapters_as_one_process_does_and_resume_their_adapter_checkpoint(setup):
    """model.lora under FSDP2: the frozen base and the adapters sharded together; only the adapters are gathered
    for a checkpoint and a policy version, and loaded back shard by shard."""
    tmp, config, groups = setup
    lora_config = tmp / "lora.yaml"
    settings = yaml.safe_load(config.read_text())
    settings["model"]["lora"] = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    settings["train"]["learning_rate"] = 2e-3  # adapters start at zero: a larger rate to move them in four steps
    lora_config.write_text(yaml.safe_dump(settings))
    lora = (tmp, lora_config, groups)
    one = alone(lora, "lora-one", "--store", str(tmp / "lora-store-one"), "--save-at", str(SAVE_AT))
    two = torchrun(lora, "lora-two", "--store", str(tmp / "lora-store-two"), "--save-at", str(SAVE_AT))
    resumed = torchrun(lora, "lora-resumed", "--store", str(tmp / "lora-store-two"), "--resume", str(SAVE_AT))
    assert_same_steps(two, one, range(1, STEPS + 1))
    assert_same_steps(resumed, one, range(SAVE_AT + 1, STEPS + 1))
    adapters = load_file(str(one / "model.safetensors"))
    assert len(adapters) == 3 * 3 * 2  # layers x target modules x (A, B): the base is not saved
    assert all(".lora_B." not in name or tensor.abs().max() > 1e-4 for name, tensor in adapters.items())
    snapshot = load_file(str(two / "snapshot.safetensors"))
    assert sorted(snapshot) == sorted(name.replace(".default.", ".") for name in adapters)
    for name, tensor in adapters.items():
        torch.testing.assert_close(snapshot[name.replace(".default.", ".")], tensor, **TOLERANCE, msg=name)


def test_ranks_with_fewer_micro_batches_pad_with_passes_that_do_not_count(setup):
    """The plan every rank works out for itself: its share's micro-batches, then filler up to the busiest rank."""
    _, config, groups_file = setup
    train = load_config(config).train
    batch = Batch.of([decode(g, ExperienceGroup) for g in msgpack.unpackb(groups_file.read_bytes(), raw=False)])
    rows = torch.arange(len(batch.pairs))
    # Mesh(rank, 2) not started: planning asks no other process.
    plans = [rank_passes(rows, batch.lengths, train, Mesh(rank, 2)) for rank in range(2)]
    shares = torch.tensor_split(rows, 2)
    for rank, plan in enumerate(plans):
        counted = [micro for micro, counts in plan if counts]
        assert sorted(torch.cat(counted).tolist()) == shares[rank].tolist()
        assert [micro.tolist() for micro, counts in plan if not counts] == [[0]] * (len(plan) - len(counted))
    assert len(plans[0]) == len(plans[1])
    assert [counts for _, counts in plans[1]][-1] is False  # this batch's lengths leave rank 1 a pass short


def test_trainer_nproc_launches_torchrun_and_more_than_the_gpus_is_refused_naming_the_field(setup):
    from services.cli.launch.children import trainer_command
    from services.common.config import ConfigError

    _, config, _ = setup
    plain = [sys.executable, "-m", "services.trainer", "--config", str(config)]
    assert trainer_command(load_config(config), plain) == plain  # nproc 1: the single process, unchanged
    model = load_config(config).model.model_dump()
    on_cpu = load_config(config, trainer={"nproc": 3}, model={**model, "device": "cpu"})
    assert trainer_command(on_cpu, plain, cuda_devices=0) == [
        sys.executable,
        *("-m", "services.trainer.learning.distributed", "--standalone", "--nproc-per-node=3"),
        *plain[1:],
    ]
    on_cuda = on_cpu.model_copy(update={"model": on_cpu.model.model_copy(update={"device": "cuda"})})
    with pytest.raises(ConfigError, match=r"trainer\.nproc: 3 trainer processes, one per GPU, but this machine has 2"):
        trainer_command(on_cuda, plain, cuda_devices=2)
    assert load_config(config, trainer={"nproc": 2}).trainer.nproc == 2
    with pytest.raises(ConfigError, match=r"trainer\.nproc"):
        load_config(config, trainer={"nproc": 0})
