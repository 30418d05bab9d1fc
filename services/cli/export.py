"""``rlpipe export RUN_DIR [--step N] OUT [--merge]``: a stored checkpoint as a model others load.

A full-weight run's step becomes a Hugging Face model folder (weights, config, tokenizer). A LoRA run's step becomes
the adapter in peft's format (adapter_config.json, adapter_model.safetensors: ``PeftModel.from_pretrained`` and
vLLM's ``LoRARequest`` load it over the base at model.path), or with ``--merge`` a plain model folder with the
adapter merged into the base. The step is read and checked as ``checkpoints verify`` does (manifest, hashes, the
weights load, a LoRA step's base model hash matches model.path's).
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from services.cli.verify.checkpoints import Policy
from services.common.config import RunConfig
from services.common.model.lora import adapter_tensors, write_adapter
from services.common.model.modeling import load_tokenizer
from services.common.transport.storage import open_store
from services.trainer.checkpointing.store import CheckpointStore


class ExportFailed(RuntimeError):
    """The step cannot be exported as asked; the message says why."""


def export_step(cfg: RunConfig, step: int | None, out: Path, merge: bool = False) -> str:
    """Write step ``step`` (default: the newest live one) of ``cfg``'s run to ``out``; returns what was written."""
    reader = CheckpointStore(open_store(cfg.checkpoint_url, cfg.checkpoint), cfg.run_id, cfg.checkpoint.keep_last)
    live = reader.steps()
    if not live or (step is not None and step not in live):
        raise ExportFailed(f"no live checkpoint of run {cfg.run_id!r} at step {step} (live steps: {live})")
    ckpt = reader.load(step if step is not None else live[-1])
    if merge and cfg.model.lora is None:
        raise ExportFailed("--merge is for a LoRA run (model.lora); this run trains full weights: drop --merge")
    if out.exists() and any(out.iterdir()):
        raise ExportFailed(f"{out} is not empty; name a new folder")
    policy = Policy(cfg)
    try:
        policy.load(ckpt)
    except (ValueError, RuntimeError) as error:
        raise ExportFailed(f"step {ckpt.step} does not load into {cfg.model.path}: {error}") from error
    if cfg.model.lora is not None and not merge:
        write_adapter(out, cfg.model.lora, adapter_tensors(ckpt.model).items(), cfg.model.path)
        return f"step {ckpt.step}: LoRA adapter (peft format) over {cfg.model.path} in {out}"
    # A LoRA run's policy is a PeftModel (no Hugging Face model class), its adapters merged here.
    model = policy.model if isinstance(policy.model, PreTrainedModel) else policy.model.merge_and_unload()
    model.save_pretrained(str(out))
    # The folder the policy loaded (model.path's URL fetched): the config's model.path may still be a URL.
    load_tokenizer(policy.folder).save_pretrained(str(out))
    merged = ", adapter merged" if cfg.model.lora is not None else ""
    return f"step {ckpt.step}: Hugging Face model folder{merged} in {out}"
