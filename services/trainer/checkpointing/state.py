"""What a checkpoint holds, in memory: the trainer's state beside the weights, the RNG states, and the state-dict
helpers that save a module once per tensor and load it back all or nothing.

How a step is laid out on a store is ``manifest.py``'s; reading and writing stores is ``checkpoint.py``'s.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar

import numpy as np
import torch

from services.common.model.modeling import host_state


class CheckpointCorrupt(RuntimeError):
    pass


class UnsafeCheckpoint(CheckpointCorrupt):
    """A part that would need unpickling arbitrary objects to load (a planted payload, or a pre-safetensors format)."""


class CheckpointMismatch(CheckpointCorrupt, ValueError):
    """A checkpoint whose tensors do not fit the model (keys, shapes, dtypes) or hold NaN or infinite values."""


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # dropout and sampling on the GPU draw from these, not the CPU generator
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict without aliases of shared storage (tied embeddings), as Hugging Face saves it."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor.contiguous()
    return out


def detached_copy(module: torch.nn.Module, only: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """A copy of ``module``'s state (with ``only``, of those names: a LoRA policy's adapters) in host memory that
    training cannot change, in its own dtypes (exact resume needs the float32 master weights); tensor by tensor,
    never a second whole copy on a GPU. Tied tensors are copied (and stored) once."""
    state = module.state_dict()
    return host_state(untied({name: t for name, t in state.items() if only is None or name in only}))


@dataclass(frozen=True)
class ModuleLayout:
    """What a state dict must hold to load into a module: each tensor's shape and dtype, and which names alias one
    tensor (tied embeddings: ``untied`` keeps one of them). Taken before the module is sharded, so it describes
    the whole tensors a checkpoint holds."""

    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    tied: tuple[tuple[str, ...], ...]  # names sharing one storage; each group must be present once

    @classmethod
    def of(cls, module: torch.nn.Module, only: Collection[str] | None = None) -> ModuleLayout:
        """``only``: the names a checkpoint holds when not all of them (a LoRA policy's adapters)."""
        by_storage: dict[int, list[str]] = {}
        specs = {}
        for name, tensor in module.state_dict().items():
            if only is not None and name not in only:
                continue
            by_storage.setdefault(tensor.data_ptr(), []).append(name)
            specs[name] = (tuple(tensor.shape), tensor.dtype)
        return cls(specs, tuple(tuple(names) for names in by_storage.values()))

    def check(self, state: dict[str, torch.Tensor], what: str) -> None:
        """Raise CheckpointMismatch naming every key, shape, dtype or non-finite value of ``state`` that would not
        load; nothing is changed either way."""
        problems = [f"missing {names[0]}" for names in self.tied if not any(name in state for name in names)]
        problems += [f"unexpected {name}" for name in sorted(state.keys() - self.specs.keys())]
        for name, tensor in state.items():
            if name not in self.specs:
                continue
            shape, dtype = self.specs[name]
            if tuple(tensor.shape) != shape:
                problems.append(f"{name} has shape {list(tensor.shape)}, the model {list(shape)}")
            elif tensor.dtype != dtype:
                problems.append(f"{name} is {tensor.dtype}, the model {dtype}")
            elif tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                problems.append(f"{name} holds NaN or infinite values")
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise CheckpointMismatch(f"{what} does not fit the model: {shown}")


def widened(ckpt: Checkpoint, layout: ModuleLayout) -> Checkpoint:
    """``ckpt`` with weights saved in the serving dtype (``checkpoint.weights_dtype: serving``) cast back to the
    dtypes of ``layout`` (the model's); any other checkpoint as it is, so a dtype that does not fit is still refused
    (``ModuleLayout.check``)."""
    if not ckpt.state.weights_dtype:
        return ckpt
    model = {
        name: tensor.to(layout.specs[name][1]) if name in layout.specs and tensor.is_floating_point() else tensor
        for name, tensor in ckpt.model.items()
    }
    return replace(ckpt, model=model)


@dataclass(frozen=True)
class LearnerLayout:
    """What a checkpoint must hold to load into a learner whole: the model the run started from (the base its
    adapters sit on, with LoRA), the policy's and critic's tensors, and AdamW's parameter groups and moment shapes.
    Taken when the learner is built, before sharding splits its tensors."""

    base_model: tuple[str, str]  # path and sha256 (lora.base_identity) of model.path
    adapters: bool  # LoRA: the checkpoint holds adapters over that base, which must match exactly
    model_path: str  # the run's model.path, named when the base differs
    algorithm: str
    model: ModuleLayout
    critic: ModuleLayout | None  # None: the algorithm has no critic
    optimizer_groups: tuple[int, ...]  # tensors per parameter group
    parameter_shapes: tuple[tuple[int, ...], ...]  # the trained parameters' shapes, in the optimizer's order

    def check(self, ckpt: Checkpoint) -> None:
        """Raise CheckpointMismatch naming what of ``ckpt`` would not load: another base model, the weights' and the
        critic's keys, shapes, dtypes and finite values, the optimizer's parameter groups and moment shapes."""
        saved = ckpt.state.base_model_sha256
        # The path may differ: a copy of the same weights. A full-weight checkpoint saved before the hash was
        # recorded has none to compare.
        if saved != self.base_model[1] and (self.adapters or saved):
            holds = "adapters for the base model" if self.adapters else "weights trained from the model"
            why = "" if self.adapters else " (unless reference.model_path is set, the run's KL reference is that model)"
            raise CheckpointMismatch(
                f"step {ckpt.step} holds {holds} {ckpt.state.base_model_path or '-'} (sha256 {saved or 'none'}); "
                f"this run's model.path {self.base_model[0] or self.model_path} is sha256 {self.base_model[1]}{why}. "
                "Resume with the model the run started from, or start a new run"
            )
        ckpt = widened(ckpt, self.model)
        self.model.check(ckpt.model, f"step {ckpt.step}'s weights")
        if (self.critic is None) != (ckpt.critic is None):
            raise CheckpointMismatch(
                f"step {ckpt.step} {'has no' if ckpt.critic is None else 'has a'} critic; this run's algorithm "
                f"({self.algorithm}) {'needs' if self.critic is not None else 'has'} none"
            )
        if self.critic is not None and ckpt.critic is not None:
            self.critic.check(ckpt.critic, f"step {ckpt.step}'s critic")
        if ckpt.optimizer is not None:  # saved without it: load starts the optimizer fresh
            self._check_optimizer(ckpt.step, ckpt.optimizer)

    def _check_optimizer(self, step: int, optimizer: dict[str, Any]) -> None:
        groups = tuple(len(group["params"]) for group in optimizer.get("param_groups", []))
        if groups != self.optimizer_groups:
            raise CheckpointMismatch(
                f"step {step}'s optimizer holds parameter groups of {list(groups)} tensors, the model "
                f"{list(self.optimizer_groups)}"
            )
        index = [i for group in optimizer["param_groups"] for i in group["params"]]
        for position, key in enumerate(index):
            for name, moment in optimizer.get("state", {}).get(key, {}).items():
                if not isinstance(moment, torch.Tensor) or moment.dim() == 0:
                    continue  # the step count
                if tuple(moment.shape) != self.parameter_shapes[position]:
                    raise CheckpointMismatch(
                        f"step {step}'s optimizer {name} of parameter {position} has shape "
                        f"{list(moment.shape)}, the parameter {list(self.parameter_shapes[position])}"
                    )
                if not bool(torch.isfinite(moment).all()):
                    raise CheckpointMismatch(
                        f"step {step}'s optimizer {name} of parameter {position} holds NaN or infinite values"
                    )


def load_untied(module: torch.nn.Module, state: dict[str, torch.Tensor], only: Collection[str] | None = None) -> None:
    """Load a state dict saved by ``untied``, all or nothing: it is checked whole (keys, shapes, dtypes, finite
    values) before the first tensor is copied; only the aliases of shared tensors may be absent. ``only``: the
    names the state holds when not all (a LoRA policy's adapters)."""
    ModuleLayout.of(module, only).check(state, "checkpoint")
    module.load_state_dict(state, strict=False)


def new_incarnation() -> str:
    """A fresh run incarnation id."""
    return uuid.uuid4().hex


@dataclass(kw_only=True)
class TrainerState:
    """``trainer_state.json``: what the trainer needs, besides weights, optimizer, schedule and RNG, to go on."""

    step: int
    policy_version: int
    config_version: int = 0
    data_cursor: dict[str, int] = field(default_factory=dict)  # the prompt feeder's position (epoch, index)
    last_experience_seq: int  # last EXPERIENCE stream sequence applied (or dropped) by this step
    in_flight: list[str] = field(default_factory=list)  # group ids fed as prompts and not yet applied
    eval_accuracy: float | None = None
    baseline_accuracy: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)  # the last step's metrics row
    incarnation: str = ""  # the run incarnation that wrote it; "" in files from before incarnations
    # Every group this incarnation fed at or before this id, in feeding order, has a fate ("" for none yet, and in
    # files from before it was kept): a copy of one is refused however late it comes.
    settled_through: str = ""
    applied_ids: list[str] = field(default_factory=list)  # the groups settled (any fate) above settled_through
    dead_ids: list[str] = field(default_factory=list)  # those of applied_ids settled as dead: a re-inject reopens them
    dead_seq: int = 0  # the DEAD sequence read through: a resumed trainer reads DEAD on after it
    reinjected: list[str] = field(default_factory=list)  # "<stream>:<sequence>" of each message re-injected from DEAD
    claim_keys: list[tuple[int, str]] = field(default_factory=list)  # (EXPERIENCE sequence, claim-check key)
    # The highest policy version served by the time of the save, abandoned branches included: a restart whose
    # lineage.jsonl lost its tail still serves versions past it. 0 in files from before it was kept.
    version_high_water: int = 0
    # The model the run started from: its path and content hash (services/common/model/lora.py, base_identity).
    # With model.lora the weights saved are adapters only, meaningful over exactly that base; "" in a full-weight
    # step saved before the hash was recorded.
    base_model_path: str = ""
    base_model_sha256: str = ""
    # The dtype the weights were saved in when it is not the master weights' (checkpoint.weights_dtype: serving); a
    # resume widens them back. "" for master weights, and in files from before it was kept.
    weights_dtype: str = ""

    # Fields every trainer_state.json has carried; the others default when an older file lacks them.
    REQUIRED: ClassVar[tuple[str, ...]] = ("step", "policy_version", "last_experience_seq")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> TrainerState:
        """Parse a trainer_state.json; ValueError when it is not one. Unknown keys (a newer writer's) are ignored."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"trainer_state.json holds a {type(raw).__name__}, not an object")
        missing = [name for name in cls.REQUIRED if name not in raw]
        if missing:
            raise ValueError(f"trainer_state.json lacks {missing}")
        known = {f.name for f in fields(cls)}
        values = {name: value for name, value in raw.items() if name in known}
        # JSON has no tuples: pairs come back as lists.
        values["claim_keys"] = [(int(seq), str(key)) for seq, key in values.get("claim_keys", [])]
        return cls(**values)


@dataclass
class Checkpoint:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None  # None: saved without it (checkpoint.optimizer_every); a resume starts it fresh
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    state: TrainerState
    critic: dict[str, torch.Tensor] | None = None
    lineage: str = ""  # lineage.jsonl up to this step
    extras: dict[str, bytes] | None = None  # kept for operators, not loaded: effective config, build info

    @property
    def incarnation(self) -> str:
        """The run incarnation that saved it; "" for a checkpoint from before incarnations."""
        return self.state.incarnation
