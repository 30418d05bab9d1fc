"""What a checkpoint and weight sync take from the learner and give back: the policy's weights, a host copy of
weights, critic and optimizer, and loading all of it (with its schedule and RNG streams) from a checkpoint, in one
process or sharded across the trainer's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from services.common.model.lora import adapter_tensors
from services.common.model.modeling import host_copy
from services.common.transport.weightsync.snapshot import HostStaging, Snapshot
from services.trainer.checkpointing.state import (
    Checkpoint,
    LearnerLayout,
    detached_copy,
    restore_rng,
    rng_state,
    untied,
    widened,
)
from services.trainer.learning.critic import Critic
from services.trainer.learning.distributed import Mesh, Op

if TYPE_CHECKING:
    from peft import PeftModel


@dataclass
class LearnerState:
    """What a checkpoint takes from the learner besides schedule and RNG, in host memory and one process's format
    whatever the world size: full tensors by name (tied ones once) and AdamW's ``state_dict``."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None  # None: not asked for (a save without optimizer state)
    critic: dict[str, torch.Tensor] | None


class LearnerStateIO:
    """The state half of ``Learner`` (services/trainer/learning/learner.py), over the attributes its constructor
    sets."""

    mesh: Mesh
    model: PreTrainedModel | PeftModel
    adapter_names: set[str] | None
    critic: Critic | None
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    generator: torch.Generator
    layout: LearnerLayout
    staging: HostStaging
    steps_done: int

    def rng_state(self) -> dict[str, Any]:
        return {**rng_state(), "minibatch_order": self.generator.get_state()}

    # --- full state: weight sync, checkpoints ------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """What a policy version is, in host memory: the full state dict (tied names share a tensor), or with LoRA
        the adapters under peft's saved names; ``{}`` on ranks but 0."""
        with self.mesh.command(Op.WEIGHTS):
            state = self.mesh.gather_module(self.model, self.adapter_names)
        return state if self.adapter_names is None else adapter_tensors(state)

    def snapshot(self, version: int, step: int) -> Snapshot:
        """The policy's weights as weight sync serves them, as ``version`` made at ``step``: with LoRA only the
        adapters, which the rollout loads over the base it holds.

        In one process they are copied into ``staging``'s reused host memory (from a GPU, queued on a copy stream
        that the next step's kernels wait for: see ``HostStaging``); across processes they are gathered."""
        if self.mesh.distributed:
            return Snapshot(version=version, step=step, tensors=tuple(self.weights().items()))
        state = self.model.state_dict()
        if self.adapter_names is not None:
            state = adapter_tensors({name: t for name, t in state.items() if name in self.adapter_names})
        return self.staging.copy(state.items(), version, step)

    def state(self, optimizer: bool = True) -> LearnerState:
        """A host-memory copy of weights, critic and (with ``optimizer``) optimizer state that training cannot
        change (rank 0's is complete; the others' empty)."""
        if not self.mesh.distributed:
            return LearnerState(
                model=detached_copy(self.model, self.adapter_names),
                optimizer=host_copy(self.optimizer.state_dict()) if optimizer else None,
                critic=detached_copy(self.critic) if self.critic is not None else None,
            )
        with self.mesh.command(Op.STATE):  # every rank gathers alike: the followers do not know what is kept
            model = untied(self.mesh.gather_module(self.model, self.adapter_names))
            critic = untied(self.mesh.gather_module(self.critic)) if self.critic is not None else None
            gathered = self.mesh.gather_optimizer(self.optimizer)
        return LearnerState(model=model, optimizer=gathered if optimizer else None, critic=critic)

    def check(self, ckpt: Checkpoint) -> None:
        """Raise CheckpointMismatch unless ``ckpt`` loads whole (``LearnerLayout.check``). Changes nothing, so a
        caller checks first and then switches (``load``), and a checkpoint that does not fit leaves the model as it
        was."""
        self.layout.check(ckpt)

    def load(self, ckpt: Checkpoint | None) -> None:
        """Everything a checkpoint holds about learning: weights, critic, optimizer, schedule, RNG streams.

        Rank 0 checks the checkpoint whole first (``check``): one that does not fit raises before anything changes.
        Across processes rank 0 passes the checkpoint it read and the others None: each keeps its shards."""
        if ckpt is not None:
            ckpt = widened(ckpt, self.layout.model)
            self.check(ckpt)
        if self.mesh.distributed:
            self._load_sharded(ckpt)
            return
        assert ckpt is not None
        # Checked whole above: only the aliases of tied tensors are absent, and they share the storage loaded.
        self.model.load_state_dict(ckpt.model, strict=False)
        if self.critic is not None and ckpt.critic is not None:
            self.critic.load_state_dict(ckpt.critic, strict=False)
        if ckpt.optimizer is not None:
            self.optimizer.load_state_dict(ckpt.optimizer)
        else:
            self.optimizer.state.clear()  # saved without it (checkpoint.optimizer_every): AdamW's moments start at 0
        self.scheduler.load_state_dict(ckpt.scheduler)
        restore_rng(ckpt.rng)
        self.generator.set_state(ckpt.rng["minibatch_order"])
        self.steps_done = ckpt.step

    def _load_sharded(self, ckpt: Checkpoint | None) -> None:
        with self.mesh.command(Op.LOAD):
            small = self.mesh.share(
                {
                    "step": ckpt.step,
                    "scheduler": ckpt.scheduler,
                    "rng": ckpt.rng,
                    "critic": ckpt.critic is not None,
                    "optimizer": ckpt.optimizer is not None,
                }
                if ckpt is not None
                else None
            )
            self.mesh.load_module(self.model, ckpt.model if ckpt is not None else None, self.adapter_names)
            if self.critic is not None and small["critic"]:
                self.mesh.load_module(self.critic, ckpt.critic if ckpt is not None else None)
            if small["optimizer"]:
                self.mesh.load_optimizer(self.optimizer, ckpt.optimizer if ckpt is not None else None)
            else:
                self.optimizer.state.clear()
        self.scheduler.load_state_dict(small["scheduler"])
        restore_rng(small["rng"])
        self.generator.set_state(small["rng"]["minibatch_order"])
        self.steps_done = small["step"]
