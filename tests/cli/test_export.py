"""`rlpipe export`: a stored step as a peft adapter, a merged model folder, or a full-weight run's model folder, each
loaded back by peft / transformers and scoring as the trainer's policy did; `checkpoints verify` reads LoRA steps."""

import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from services.cli.app import app
from services.cli.verify.checkpoints import verify_checkpoints
from services.common.config import load_config
from services.common.model.lora import base_identity
from services.common.model.modeling import load_model
from services.common.transport.storage import open_store
from services.trainer.checkpointing.state import Checkpoint, TrainerState
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.learning.learner import Learner
from tests.support.runs import write_config

pytestmark = pytest.mark.integration

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
IDS = torch.tensor([[5, 9, 12, 7, 3, 20, 11]])


def trained_run(tmp_path, tiny_model, lora):
    """A run directory with one stored step of a policy moved away from the base, and that policy."""
    model_dir, data_dir = tiny_model
    run_dir = tmp_path / "runs" / "test"
    run_dir.mkdir(parents=True)
    config = write_config(
        run_dir / "effective-config.yaml", model_dir, data_dir, tmp_path / "runs", model={"lora": lora}
    )
    cfg = load_config(config)
    learner = Learner(cfg)
    torch.manual_seed(3)
    with torch.no_grad():
        for param in learner.model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn_like(param))
    state = learner.state()
    store = CheckpointStore(open_store(cfg.checkpoint_url, cfg.checkpoint), cfg.run_id, 2, incarnation="i")
    path, sha = learner.base_model
    trainer_state = TrainerState(
        step=3, policy_version=3, last_experience_seq=0, incarnation="i", base_model_path=path, base_model_sha256=sha
    )
    store.save(
        Checkpoint(3, state.model, state.optimizer, learner.scheduler.state_dict(), learner.rng_state(), trainer_state),
        model_dir,
    )
    learner.model.eval()
    with torch.no_grad():
        expected = learner.model(input_ids=IDS).logits
    return cfg, run_dir, expected


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def test_a_lora_step_exports_as_a_peft_adapter_and_as_a_merged_model_that_score_as_the_trainer(tmp_path, tiny_model):
    cfg, run_dir, expected = trained_run(tmp_path, tiny_model, LORA)
    assert (logits(load_model(cfg.model.path)) - expected).abs().max() > 1e-3  # the adapter changed the policy
    runner = CliRunner()
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    done = runner.invoke(app, ["export", str(run_dir), str(adapter), "--step", "3"])
    assert done.exit_code == 0, done.output
    assert "LoRA adapter (peft format)" in done.output
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    peft_model = PeftModel.from_pretrained(load_model(cfg.model.path), str(adapter))
    torch.testing.assert_close(logits(peft_model), expected, atol=1e-5, rtol=1e-5)

    done = runner.invoke(app, ["export", str(run_dir), str(merged), "--merge"])
    assert done.exit_code == 0, done.output
    plain = AutoModelForCausalLM.from_pretrained(str(merged))
    assert not any("lora" in name for name, _ in plain.named_parameters())
    torch.testing.assert_close(logits(plain), expected, atol=1e-4, rtol=1e-4)

    [check] = verify_checkpoints(cfg)
    assert check.ok, check.detail


def test_a_full_weight_step_exports_as_a_model_folder_and_merge_is_refused(tmp_path, tiny_model):
    _, run_dir, expected = trained_run(tmp_path, tiny_model, None)
    runner = CliRunner()
    refused = runner.invoke(app, ["export", str(run_dir), str(tmp_path / "m"), "--merge"])
    assert refused.exit_code == 2
    assert "--merge is for a LoRA run" in refused.output
    done = runner.invoke(app, ["export", str(run_dir), str(tmp_path / "full")])
    assert done.exit_code == 0, done.output
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "full"))), expected)


def test_a_lora_step_over_another_base_fails_verify_and_export_naming_both_hashes(tmp_path, tiny_model):
    cfg, run_dir, _ = trained_run(tmp_path, tiny_model, LORA)
    other = tmp_path / "other-base"
    shutil.copytree(cfg.model.path, other)
    weights = other / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\x00\x00\x80\x3f")
    moved = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": other})})
    [check] = verify_checkpoints(moved)
    assert not check.ok
    saved = load_config(run_dir / "effective-config.yaml")
    for digest in (base_identity(saved.model.path)[1], base_identity(other)[1]):
        assert digest in check.detail
