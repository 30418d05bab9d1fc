"""``rlpipe checkpoints verify [STEP|--all]``: are the stored checkpoints whole, and do they load?

Each step is checked on the checkpoint store and on its mirror, with the trainer's own reader
(``CheckpointStore.load``): the manifest parses and every part matches its size and sha256 (a
flipped byte in ``model.safetensors`` is reported naming the step and the file). Then the
weights go into the configured model (``load_untied``, as a resume does), so a checkpoint that
is whole but does not fit the model (another architecture, a renamed tensor) fails too.
With ``model.lora`` a step holds adapters only: they go into the base model with adapters attached, and a step
trained over another base (its content hash differs from model.path's) fails naming both hashes.
Abandoned steps are not checked: no loader uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedModel

from services.common.config import RunConfig
from services.common.model.lora import attach_adapters, base_identity
from services.common.model.modeling import load_model
from services.common.transport.model_source import resolve_model
from services.common.transport.storage import ObjectStore, open_store
from services.trainer.checkpointing.state import Checkpoint, ModuleLayout, load_untied, widened
from services.trainer.checkpointing.store import UNREADABLE, CheckpointStore

if TYPE_CHECKING:
    from peft import PeftModel


@dataclass(frozen=True)
class StepCheck:
    store: str  # the store's URL
    step: int
    ok: bool
    detail: str


def stores(cfg: RunConfig) -> list[ObjectStore]:
    """The checkpoint store, then its mirror when one is configured."""
    urls = [cfg.checkpoint_url] + ([cfg.checkpoint.mirror_url] if cfg.checkpoint.mirror_url else [])
    return [open_store(url, cfg.checkpoint) for url in urls]


class Policy:
    """The run's policy model as a checkpoint loads into it: the model at model.path, with LoRA adapters attached
    when the run trains them (then a checkpoint holds those alone, over the base whose hash ``base_sha256`` is)."""

    def __init__(self, cfg: RunConfig):
        cfg = resolve_model(cfg)  # model.path's URL as the folder it was fetched to (fetched now if need be)
        self.folder = cfg.model.folder
        self.model: PreTrainedModel | PeftModel = load_model(self.folder, "float32")
        self.adapter_names: set[str] | None = None
        self.base_sha256 = ""
        if cfg.model.lora is not None:
            self.model = attach_adapters(self.model, cfg.model.lora, self.folder)
            self.adapter_names = {name for name, p in self.model.named_parameters() if p.requires_grad}
            self.base_sha256 = base_identity(self.folder)[1]

    def load(self, ckpt: Checkpoint) -> None:
        """``ckpt``'s weights into the model, all or nothing; ValueError naming both hashes when its adapters were
        trained over another base model."""
        # A full-weight checkpoint loads whole whatever model.path holds now; adapters only over their base.
        if self.adapter_names is not None and ckpt.state.base_model_sha256 != self.base_sha256:
            raise ValueError(
                f"step {ckpt.step} was trained over the base model of sha256 "
                f"{ckpt.state.base_model_sha256 or 'none (full weights)'}; model.path is sha256 "
                f"{self.base_sha256 or 'none (full weights)'}"
            )
        layout = ModuleLayout.of(self.model, self.adapter_names)
        load_untied(self.model, widened(ckpt, layout).model, self.adapter_names)  # serving-dtype weights widened


def verify_checkpoints(cfg: RunConfig, step: int | None = None, every: bool = False) -> list[StepCheck]:
    """Check ``step``, every live step (``every``), or else the newest live step, on each store.

    A store without the step (or without any step) gives a failed row saying so."""
    policy: Policy | None = None  # built once, at the first step that needs it
    results = []
    for store in stores(cfg):
        # No incarnation: every run incarnation's steps under this run id are listed and readable.
        reader = CheckpointStore(store, cfg.run_id, cfg.checkpoint.keep_last, attempts=2)
        try:
            live = reader.steps()
        except Exception as error:  # an unreachable store is a finding, not a crash
            results.append(StepCheck(store.url, -1, False, f"cannot list checkpoints: {error!r}"[:500]))
            continue
        wanted = live if every else [step] if step is not None else live[-1:]
        if not wanted:
            results.append(StepCheck(store.url, -1, False, f"no checkpoint of run {cfg.run_id!r}"))
        for number in wanted:
            if number not in live:
                results.append(StepCheck(store.url, number, False, f"no live checkpoint at step {number} ({live})"))
                continue
            try:
                ckpt = reader.load(number, store)
            except UNREADABLE as error:
                results.append(StepCheck(store.url, number, False, str(error)))
                continue
            if policy is None:
                policy = Policy(cfg)
            try:
                policy.load(ckpt)
            except (ValueError, RuntimeError) as error:  # load_state_dict raises RuntimeError on a shape mismatch
                results.append(StepCheck(store.url, number, False, f"step {number}: weights do not load: {error}"))
                continue
            results.append(
                StepCheck(
                    store.url,
                    number,
                    True,
                    f"step {number}: manifest and hashes match, {len(ckpt.model)} tensors loaded into {cfg.model.path}",
                )
            )
    return results
