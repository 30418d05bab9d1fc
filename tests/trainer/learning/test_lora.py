"""LoRA adapters in the trainer (model.lora): what trains, what is synced, what a checkpoint holds and refuses."""

import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from services.common.config import CheckpointConfig, load_config
from services.common.model.datasets import load_jsonl
from services.common.model.modeling import pack, response_logits, token_logprobs
from services.common.refusal import StartRefused
from services.common.transport.storage import open_store
from services.reference.service import ReferenceScorer
from services.trainer.checkpointing.state import Checkpoint, CheckpointMismatch, TrainerState
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.learning.learner import Learner
from tests.support.runs import write_config
from tests.support.trainer import experience

pytestmark = pytest.mark.integration

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
LAYERS = 3  # the tiny model's decoder layers


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    model_dir, data_dir = tiny_model
    tmp = tmp_path_factory.mktemp("lora")
    return model_dir, data_dir, tmp, load_jsonl(data_dir / "train.jsonl")[:6]


def config(setup, model_dir=None, lora=LORA, **train):
    base_dir, data_dir, tmp, _ = setup
    return load_config(
        write_config(
            tmp / "c.yaml",
            model_dir or base_dir,
            data_dir,
            tmp / "runs",
            model={"lora": lora},
            train={"learning_rate": 1e-2, "algorithm": "grpo", **train},
        )
    )


def make(setup, **train):
    cfg = config(setup, **train)
    torch.manual_seed(0)
    return cfg, Learner(cfg)


@pytest.fixture(scope="module")
def groups(setup):
    return experience(config(setup), setup[3])


def adapters(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad}


def test_only_the_adapters_train_have_optimizer_state_and_make_up_a_policy_version(setup, groups):
    _, learner = make(setup)
    frozen = {n: p.detach().clone() for n, p in learner.model.named_parameters() if not p.requires_grad}
    before = adapters(learner)
    assert len(before) == LAYERS * 2 * 2  # q_proj and v_proj, A and B each
    learner.step(groups, 0)
    after = adapters(learner)
    assert all(torch.equal(p, frozen[n]) for n, p in learner.model.named_parameters() if not p.requires_grad)
    # B starts at zero, so the first update moves every B (and no A yet: A's gradient is B's product).
    assert [n for n in before if not torch.equal(after[n], before[n])] == [n for n in before if ".lora_B." in n]
    assert len(learner.optimizer.state_dict()["state"]) == len(before)

    snapshot = learner.snapshot(version=1, step=1)
    names = [name for name, _ in snapshot.tensors]
    assert len(names) == len(before)
    assert all(".lora_A.weight" in name or ".lora_B.weight" in name for name in names)  # peft's saved names
    assert snapshot.total_bytes == sum(t.numel() * 4 for t in after.values())


def test_lora_micro_batches_and_gradient_checkpointing_make_the_same_update(setup, groups):
    _, whole = make(setup)
    _, split = make(setup, grad_accum_steps=4, gradient_checkpointing=True)
    whole.step(groups, 0)
    split.step(groups, 0)
    one, four = adapters(whole), adapters(split)
    assert any(not torch.equal(t, torch.zeros_like(t)) for n, t in one.items() if "lora_B" in n)
    for name in one:
        torch.testing.assert_close(four[name], one[name], atol=1e-6, rtol=1e-5, msg=name)


def save_and_load(learner: Learner, tmp_path, model_dir) -> Checkpoint:
    store = CheckpointStore(open_store(tmp_path.as_uri(), CheckpointConfig()), "lora", keep_last=2, incarnation="i")
    state = learner.state()
    path, sha = learner.base_model
    store.save(
        Checkpoint(
            1,
            state.model,
            state.optimizer,
            learner.scheduler.state_dict(),
            learner.rng_state(),
            TrainerState(
                step=1,
                policy_version=1,
                last_experience_seq=0,
                incarnation="i",
                base_model_path=path,
                base_model_sha256=sha,
            ),
        ),
        model_dir,
    )
    return store.load_latest()


def test_a_lora_checkpoint_holds_adapters_only_and_resumes_the_next_step_exactly(setup, groups, tmp_path):
    model_dir = setup[0]
    cfg, first = make(setup, epochs=2, mini_batches=2)
    first.step(groups[:3], 0)
    ckpt = save_and_load(first, tmp_path, model_dir)
    assert set(ckpt.model) == {n for n, p in first.model.named_parameters() if p.requires_grad}
    assert ckpt.state.base_model_sha256 == first.base_model[1]
    first.step(groups[3:], 1)

    torch.manual_seed(0)
    resumed = Learner(cfg)
    resumed.load(ckpt)
    resumed.step(groups[3:], 1)
    for name, tensor in adapters(first).items():
        assert torch.equal(adapters(resumed)[name], tensor), name


@pytest.mark.parametrize(
    ("lora", "holds"),
    [
        (LORA, "holds adapters for the base model"),
        # Full weights load whole, but the run's tokenizer and KL reference come from model.path.
        (None, "holds weights trained from the model"),
    ],
)
def test_a_resume_over_another_base_model_is_refused_naming_both_hashes(setup, tmp_path, lora, holds):
    model_dir = setup[0]
    torch.manual_seed(0)
    learner = Learner(config(setup, lora=lora))
    ckpt = save_and_load(learner, tmp_path / "store", model_dir)
    assert ckpt.state.base_model_sha256 == learner.base_model[1] != ""
    other = tmp_path / "other-base"
    shutil.copytree(model_dir, other)
    weights = other / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\x00\x00\x80\x3f")  # the last float32 weight becomes 1.0
    moved = Learner(config(setup, model_dir=other, lora=lora))
    with pytest.raises(CheckpointMismatch) as refused:
        moved.check(ckpt)
    assert holds in str(refused.value)
    assert ckpt.state.base_model_sha256 in str(refused.value)
    assert moved.base_model[1] in str(refused.value)
    assert moved.base_model[1] != ckpt.state.base_model_sha256
    if lora is None:  # a full-weight checkpoint saved before the hash was recorded has nothing to compare
        moved.check(replace(ckpt, state=replace(ckpt.state, base_model_path="", base_model_sha256="")))


def test_target_modules_matching_no_linear_module_refuse_the_start_naming_the_models_modules(setup):
    cfg = config(setup, lora={**LORA, "target_modules": ["q_proj", "query"]})
    with pytest.raises(StartRefused, match=r"model.lora.target_modules: \['query'\] match no Linear module") as refused:
        Learner(cfg)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in str(refused.value)


def test_the_reference_scores_with_the_base_which_is_the_lora_policy_with_its_adapters_off(setup, groups):
    cfg, learner = make(setup)
    learner.step(groups, 0)
    learner.model.eval()
    pairs = [(g.prompt_ids.tolist(), c.token_ids.tolist()) for g in groups for c in g.completions]
    batch = pack(pairs, learner.tokenizer.pad_token_id)
    with torch.no_grad(), learner.model.disable_adapter():
        base = token_logprobs(response_logits(learner.model, batch), batch.targets)
    with torch.no_grad():
        policy = token_logprobs(response_logits(learner.model, batch), batch.targets)
    reference = [row for g in ReferenceScorer(cfg)(groups) for row in g.ref_logprobs]
    assert (policy - base).abs().max() > 1e-3  # the adapters moved the policy away from the base
    for row, expected, (_, response) in zip(reference, base, pairs, strict=True):
        np.testing.assert_allclose(row, expected[: len(response)].numpy(), atol=1e-5)
