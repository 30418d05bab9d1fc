"""Devices and precision on the CPU: where models land, which dtypes their weights and activations have,
fp32 master weights under bfloat16 autocast, gradient checkpointing, and host copies of state."""

import math

import pytest
import torch

from services.common.config import ConfigError, load_config
from services.common.model.datasets import load_jsonl
from services.common.model.evaluation import greedy_generate
from services.common.model.modeling import Precision, host_copy, host_state, load_tokenizer, resolve_device
from services.reference.service import ReferenceScorer
from services.trainer.learning.batch import Batch
from services.trainer.learning.learner import Learner
from tests.support.runs import write_config
from tests.support.trainer import experience

pytestmark = pytest.mark.integration

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    model_dir, data_dir = tiny_model
    return model_dir, data_dir, tmp_path_factory.mktemp("precision"), load_jsonl(data_dir / "train.jsonl")[:4]


def config(setup, model=None, **train):
    model_dir, data_dir, tmp, _ = setup
    path = write_config(
        tmp / "c.yaml", model_dir, data_dir, tmp / "runs", model={"path": str(model_dir), **(model or {})}, train=train
    )
    return load_config(path)


@pytest.fixture
def no_gpu(monkeypatch):
    """This process sees no CUDA device, whatever machine runs the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def lm_head_dtypes(model: torch.nn.Module) -> tuple[list[torch.dtype], torch.utils.hooks.RemovableHandle]:
    """Record the dtype of every lm_head output: bfloat16 under autocast, the weights' dtype without it."""
    seen: list[torch.dtype] = []
    return seen, model.lm_head.register_forward_hook(lambda _module, _inputs, out: seen.append(out.dtype))


# --- devices ------------------------------------------------------------------------------------


@pytest.mark.unit
def test_auto_is_cuda_only_when_a_gpu_is_visible():
    assert resolve_device("auto", cuda_available=False) == torch.device("cpu")
    assert resolve_device("auto", cuda_available=True) == torch.device("cuda")
    assert resolve_device("cpu", cuda_available=True) == torch.device("cpu")


@pytest.mark.unit
def test_cuda_without_a_gpu_is_refused_naming_model_device():
    with pytest.raises(ConfigError, match=r"model\.device: 'cuda' but this process sees no CUDA device"):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(ConfigError, match=r"model\.device: 'tpu' is not one of \['auto', 'cpu', 'cuda'\]"):
        resolve_device("tpu", cuda_available=True)


def test_a_learner_on_cuda_without_a_gpu_stops_at_start_naming_model_device(setup, no_gpu):
    with pytest.raises(ConfigError, match=r"model\.device: 'cuda'"):
        Learner(config(setup, model={"device": "cuda"}))
    with pytest.raises(ConfigError, match=r"model\.device: 'cuda'"):
        ReferenceScorer(config(setup, model={"device": "cuda"}))


def test_auto_puts_trainer_critic_and_reference_on_the_cpu_here(setup, no_gpu):
    cfg = config(setup, algorithm="ppo")
    assert cfg.model.device == "auto"
    learner = Learner(cfg)
    assert learner.device == torch.device("cpu")
    assert {p.device.type for p in learner.parameters()} == {"cpu"}
    assert ReferenceScorer(cfg).precision.device == torch.device("cpu")


# --- precision ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_precision_of_the_config():
    cfg_model = type("M", (), {"dtype": "bfloat16", "device": "cpu"})
    master = Precision.of(cfg_model, "float32")
    assert (master.param_dtype, master.compute_dtype) == (F32, BF16)
    assert isinstance(master.autocast(), torch.autocast)
    frozen = Precision.of(cfg_model)  # reference, rollout: weights in model.dtype, nothing to autocast
    assert (frozen.param_dtype, frozen.compute_dtype) == (BF16, BF16)
    with frozen.autocast():
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_bfloat16_with_fp32_master_weights_keeps_parameters_and_adam_in_fp32(setup, algorithm):
    cfg = config(setup, model={"dtype": "bfloat16"}, algorithm=algorithm, old_logprobs="recompute")
    assert cfg.train.master_weights == "float32"  # the default
    torch.manual_seed(0)
    learner = Learner(cfg)
    groups = experience(cfg, setup[3])
    assert {p.dtype for p in learner.parameters()} == {F32}
    before = torch.cat([p.detach().flatten() for p in learner.model.parameters()])
    seen, hook = lm_head_dtypes(learner.model)
    try:
        metrics = learner.step(groups, 0)
    finally:
        hook.remove()
    # Every forward (scoring and the update) ran in bfloat16; the weights it updated are still float32.
    assert seen and set(seen) == {BF16}
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert {p.dtype for p in learner.parameters()} == {F32}
    assert not torch.equal(before, torch.cat([p.detach().flatten() for p in learner.model.parameters()]))
    moments = [s[key] for s in learner.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {F32}


def test_master_weights_in_the_model_dtype_store_parameters_and_adam_in_bfloat16(setup):
    cfg = config(setup, model={"dtype": "bfloat16"}, master_weights="model_dtype")
    torch.manual_seed(0)
    learner = Learner(cfg)
    assert {p.dtype for p in learner.parameters()} == {BF16}
    metrics = learner.step(experience(cfg, setup[3]), 0)
    assert math.isfinite(metrics["loss"])
    moments = [s[key] for s in learner.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {BF16}


def test_float32_runs_without_autocast(setup):
    learner = Learner(config(setup))
    seen, hook = lm_head_dtypes(learner.model)
    try:
        learner._score(Batch.of(experience(learner.cfg, setup[3][:1])), policy=True)
    finally:
        hook.remove()
    assert seen == [F32]


def test_reference_scores_in_bfloat16_weights(setup):
    rows = setup[3][:2]
    full, half = ReferenceScorer(config(setup)), ReferenceScorer(config(setup, model={"dtype": "bfloat16"}))
    assert {p.dtype for p in half.model.parameters()} == {BF16}
    cfg = config(setup)
    groups = experience(cfg, rows)
    exact = [r for g in groups for r in g.ref_logprobs]
    rounded = [r for g in half(groups) for r in g.ref_logprobs]
    assert all(a.dtype == b.dtype for a, b in zip(exact, rounded, strict=True))
    gap = max(float(abs(a - b).max()) for a, b in zip(exact, rounded, strict=True))
    # bfloat16 has 8 bits of mantissa: the scores move, by a few hundredths of a nat at most on this model.
    assert 0 < gap < 0.1
    assert full.precision.param_dtype == F32


def test_evaluation_runs_under_the_trainers_autocast(setup):
    cfg = config(setup, model={"dtype": "bfloat16"})
    learner = Learner(cfg)
    tokenizer = load_tokenizer(cfg.model.path)
    prompts = [row["prompt"] for row in setup[3][:2]]
    seen, hook = lm_head_dtypes(learner.model)
    try:
        with_precision = greedy_generate(learner.model, tokenizer, prompts, 3, precision=learner.precision)
        assert seen and set(seen) == {BF16}
        seen.clear()
        greedy_generate(learner.model, tokenizer, prompts, 3)
        assert seen and set(seen) == {F32}
    finally:
        hook.remove()
    assert len(with_precision) == 2


# --- gradient checkpointing ---------------------------------------------------------------------


def test_gradient_checkpointing_recomputes_the_layers_and_gives_the_same_gradients(setup):
    grads, layer_calls = [], []
    for checkpointing in (False, True):
        cfg = config(setup, algorithm="ppo", gradient_checkpointing=checkpointing)
        torch.manual_seed(0)
        learner = Learner(cfg)
        assert learner.model.is_gradient_checkpointing is checkpointing
        assert learner.critic.backbone.is_gradient_checkpointing is checkpointing
        torch.nn.init.normal_(learner.critic.head.weight, std=0.1, generator=torch.Generator().manual_seed(1))
        batch = Batch.of(experience(cfg, setup[3]))
        targets = learner.targets(batch)
        learner.model.train()
        calls = []
        hook = learner.model.model.layers[0].register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        try:
            learner.accumulate(batch, torch.arange(len(batch.pairs)), targets)
        finally:
            hook.remove()
        layer_calls.append(len(calls))
        grads.append(
            {
                name: p.grad.clone()
                for name, p in [
                    *learner.model.named_parameters(),
                    *((f"critic.{name}", p) for name, p in learner.critic.named_parameters()),
                ]
            }
        )
    # One micro-batch: its forward, then (a pre-hook: the recomputation stops once it has what backward needs) again.
    assert layer_calls == [1, 2]
    for name, plain in grads[0].items():
        torch.testing.assert_close(grads[1][name], plain, rtol=1e-5, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for name, g in grads[1].items() if name.startswith("critic.backbone"))


# --- host copies --------------------------------------------------------------------------------


@pytest.mark.unit
def test_host_state_copies_each_tensor_and_casts_only_floating_point():
    state = {"w": torch.randn(3, 2), "ids": torch.arange(4)}
    copied = host_state(state, dtype=BF16)
    assert (copied["w"].dtype, copied["ids"].dtype) == (BF16, torch.int64)
    torch.testing.assert_close(copied["w"], state["w"].to(BF16))
    assert torch.equal(copied["ids"], state["ids"])
    same = host_state(state)
    state["w"].add_(1.0)  # training goes on: the copies must not move
    assert copied["w"].device.type == "cpu" and same["w"].dtype == F32
    assert not torch.equal(same["w"], state["w"])


@pytest.mark.unit
def test_host_copy_of_optimizer_state_is_equal_and_independent():
    weight = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.sum().backward()
    optimizer.step()
    saved = host_copy(optimizer.state_dict())
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    assert saved["param_groups"] == optimizer.state_dict()["param_groups"]
    assert torch.equal(saved["state"][0]["exp_avg"], exp_avg)
    optimizer.step()  # moves the live moments, not the copy
    assert torch.equal(saved["state"][0]["exp_avg"], exp_avg)
    fresh = torch.optim.AdamW([torch.nn.Parameter(weight.detach().clone())], lr=0.1)
    fresh.load_state_dict(saved)  # what resume does with it
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], exp_avg)
