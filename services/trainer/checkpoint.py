"""Trainer checkpoints at ``<store>/<run>/step-<N>/``.

Parts go up first (model as safetensors with its HF config and tokenizer, so a
step folder is itself a loadable model; the PPO critic; optimizer; LR scheduler; RNG states; trainer state; lineage),
then ``manifest.json`` with every part's size and sha256. Nothing is unpickled on load: weights are safetensors, the
optimizer, scheduler and RNG states load with ``torch.load(weights_only=True)`` (tensors, numbers, strings and
containers only), and a part holding any other object is refused with ``UnsafeCheckpoint``. A step without a
manifest, or whose parts do not match it, does not exist for loaders. The manifest names its ``format``
(``CHECKPOINT_FORMAT``): a step of a newer format is refused by name (``UnknownCheckpointFormat``), one
without the field is read as format 1.

Two marker objects sit beside a manifest: ``STABLE`` (an operator or a healthy save
vouched for the step; pruning keeps it and ``rollback --stable`` goes to the newest)
and ``ABANDONED`` (a rollback or a resume went back before it; loaders skip it and pruning
drops it first, while lineage.jsonl keeps the record of what it trained).

Incarnations
------------
Every start of a run that is not a resume is a new *incarnation* with a fresh id
(``start_fresh``); a resume takes over the id of the checkpoint it continues
(``adopt_incarnation``). Every manifest carries the id. Once a ``CheckpointStore`` knows its
incarnation, steps whose manifest names another one are *foreign*: they are not listed,
loaded, vouched for, abandoned, counted for the replay floor, pruned or overwritten; they
belong to another run that happens to share the prefix. A manifest without the field
(written before incarnations existed) belongs to whichever incarnation resumes it. A store
whose incarnation is still None (a trainer that has not yet decided between resuming and a
fresh start) sees every step and cannot save.

A fresh start on a prefix that already holds checkpoints is refused (``check_fresh_start``
raises ``ForeignCheckpoints``) rather than run beside them: a restarted trainer finds its
checkpoint with ``load_latest`` before it knows its incarnation, and would take the newest
step of either run.

What a reader sees while ``save`` runs
--------------------------------------
- A new step: nothing until its manifest lands (parts first, manifest last).
- The same step saved again by the same incarnation with the same policy version and
  EXPERIENCE sequence (a retry after a failed prune or mirror copy, or "checkpoint now" on
  a step just saved): nothing changes. The stored copy (and its STABLE mark) stands; only
  pruning and the mirror copy are redone. The stored parts are not re-verified.
- A step of the same number from another branch (an abandoned step, or a live copy with a
  different policy version or sequence): the old copy is marked ABANDONED first unless it
  already is, so from then on every reader skips it as it skips any abandoned step. Then
  parts the new copy does not have (and the old STABLE mark) are deleted, the new parts and
  the new manifest are written, and the ABANDONED mark is deleted last: the new copy exists
  from that moment. An interrupted save leaves an abandoned step, which the next save of
  that number replaces and pruning drops first. Other live steps are never touched, so at
  no moment is a live step of the current branch without a loadable copy.
- A foreign step of the same number: the save raises ``ForeignCheckpoints`` and writes nothing.
- Pruning deletes a step's manifest before its parts: the step vanishes at once rather than
  being seen half-deleted (a reader that listed it just before finds it missing or corrupt
  and takes another step, as ``load_latest`` does).

Once the manifest and its markers are on the primary store the step is stored: a failure
while pruning or copying to the mirror afterwards is logged (``prune_failed``,
``mirror_failed``) and ``save`` returns normally; the next save prunes and mirrors again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import random
import re
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from services.common.model.modeling import host_state
from services.common.observe.logs import log_event
from services.common.transport.storage import ObjectStore
from services.common.transport.weightsync.snapshot import NonFiniteWeights, non_finite
from services.trainer.resume import CheckpointsMissing, StoreListing, StoreUnreadable, resume_candidates

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# The layout of a step folder. 1: written before the manifest named its format (read as such: trainer_state.json
# fields added since default, and a pickled rng.pkl is refused by name). A step of a newer format is refused by
# name, never skipped for an older step: that would silently abandon the newer one's training.
CHECKPOINT_FORMAT = 2
REQUIRED_PARTS = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "lineage.jsonl")
STABLE = "STABLE"
ABANDONED = "ABANDONED"
PURGED = "experience-purged.json"  # beside the step folders: how far this run purged EXPERIENCE (record_purge)
FENCE = "FENCE"  # beside the step folders: the highest lease epoch that claimed this prefix (claim_fence)
_STEP_FILE = re.compile(r"step-(\d+)/(manifest\.json|STABLE|ABANDONED)$")
MODEL_SIDECARS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _safe_torch_load(data: bytes, what: str) -> Any:
    """``data`` saved by ``torch.save``, unpickled only as far as tensors, numbers, strings and containers go:
    a checkpoint is data, and loading one must never run code that a writer of the store planted in it."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0][:200]
        raise UnsafeCheckpoint(
            f"{what} holds something other than tensors, numbers and containers and is refused unopened "
            f"(rlpipe never unpickles objects from a checkpoint): {reason}"
        ) from None


def _rng_bytes(state: dict[str, Any]) -> bytes:
    """The RNG states as ``torch.save`` bytes that load with ``weights_only``: numpy's key array becomes a tensor."""
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    stored = {**state, "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian)}
    return _torch_bytes(stored)


def _rng_from_bytes(data: bytes, what: str) -> dict[str, Any]:
    state = _safe_torch_load(data, what)
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    return {**state, "numpy": (name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian)}


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
    # With model.lora the weights saved are adapters only, meaningful over exactly one base model: its path and
    # content hash (services/common/model/lora.py, base_identity). "" for full weights.
    base_model_path: str = ""
    base_model_sha256: str = ""

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
    optimizer: dict[str, Any]
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


class CheckpointCorrupt(RuntimeError):
    pass


class UnsafeCheckpoint(CheckpointCorrupt):
    """A part that would need unpickling arbitrary objects to load (a planted payload, or a pre-safetensors format)."""


class CheckpointMismatch(CheckpointCorrupt, ValueError):
    """A checkpoint whose tensors do not fit the model (keys, shapes, dtypes) or hold NaN or infinite values."""


class UnknownCheckpointFormat(RuntimeError):
    """A step written in a format this rlpipe does not read (a newer rlpipe's): refused by name, never skipped."""


@dataclass
class Resumable:
    """What a resume found: the newest loadable step, and the newer ones it had to pass over (step -> why)."""

    checkpoint: Checkpoint | None
    skipped: dict[int, str] = field(default_factory=dict)


class AbandonedStep(ValueError):
    pass


class FencedOut(RuntimeError):
    """A trainer of a higher lease epoch claimed this run's prefix: this one's writes are refused."""


class ForeignCheckpoints(RuntimeError):
    """Checkpoints of another run incarnation are in the way: a fresh start over them, or a save over one."""

    def __init__(self, message: str, found: dict[str, list[int]]):
        super().__init__(message)
        self.found = found  # store prefix (url/run_id/) -> the steps found there


# What a stored copy that cannot be used raises: another copy or an older step may do.
UNREADABLE = (CheckpointCorrupt, OSError, KeyError, ValueError)


@dataclass
class _Stored:
    """One step on one store, as a listing and its manifest show it."""

    step: int
    names: set[str]  # which of manifest.json, STABLE and ABANDONED it has
    manifest: dict[str, Any] | None  # None: not read, or unreadable

    @property
    def owner(self) -> str | None:
        return self.manifest.get("incarnation") if self.manifest is not None else None

    @property
    def live(self) -> bool:
        return ABANDONED not in self.names


def _read_manifest(data: bytes) -> dict[str, Any] | None:
    """The manifest as a dict, or None when it is not one (bitrot): whose step it is cannot be told then."""
    try:
        manifest = json.loads(data)
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) else None


class CheckpointStore:
    def __init__(
        self,
        store: ObjectStore,
        run_id: str,
        keep_last: int,
        attempts: int = 4,
        backoff_s: float = 1.0,
        mirror: ObjectStore | None = None,
        incarnation: str | None = None,
    ):
        self.store = store
        self.mirror = mirror
        self.run_id = run_id
        self.keep_last = keep_last
        self.attempts = attempts
        self.backoff_s = backoff_s
        # None until the trainer has decided: start_fresh() or adopt_incarnation() (or a restart that knows it).
        self.incarnation = incarnation
        # The lease epoch this writer holds (claim_fence); None: a writer without a lease, never fenced.
        self.epoch: int | None = None
        # Raises when the writer's own lease has run out (Lease.check); called before the store's fence is read.
        self.guard: Callable[[], None] | None = None

    # -- incarnations -------------------------------------------------------------------

    def location(self, store: ObjectStore | None = None) -> str:
        """The run's prefix on ``store``: ``<url>/<run_id>/``."""
        return f"{(store or self.store).url.rstrip('/')}/{self.run_id}/"

    def check_fresh_start(self) -> None:
        """Raise ForeignCheckpoints when the run's prefix (on the store or its mirror) holds any checkpoint.

        A fresh start must not share a prefix with an earlier run: its steps would be pruned
        against the old ones and a restart could resume the old run. An unreachable mirror
        does not block the start (it is a second copy); an unreachable primary raises its error.
        """
        found: dict[str, list[int]] = {}
        for store in (self.store, self.mirror):
            if store is None:
                continue
            try:
                steps = self.steps(store, include_abandoned=True, include_foreign=True)
            except Exception as error:
                if store is self.store:
                    raise
                log_event(log, "mirror_failed", level=logging.WARNING, store=store.url, error=repr(error)[:300])
                continue
            if steps:
                found[self.location(store)] = steps
        if found:
            where = "; ".join(f"{prefix} holds steps {steps}" for prefix, steps in found.items())
            raise ForeignCheckpoints(
                f"checkpoints of an earlier run are in the way of a fresh start: {where}. "
                f"Continue that run with `rlpipe run --resume`, or start a new one under another run_id.",
                found,
            )

    def start_fresh(self, incarnation: str | None = None) -> str:
        """``check_fresh_start``, then take ``incarnation`` (default: a new id) for every save; returns it."""
        self.check_fresh_start()
        self.incarnation = incarnation or new_incarnation()
        return self.incarnation

    def adopt_incarnation(self, ckpt: Checkpoint) -> str:
        """Continue the incarnation that saved ``ckpt``; returns it.

        A checkpoint from before incarnations gets a new id: the steps without one stay
        this incarnation's (and anyone's that resumes them)."""
        self.incarnation = ckpt.incarnation or new_incarnation()
        return self.incarnation

    def _foreign(self, entry: _Stored) -> bool:
        owner = entry.owner
        return self.incarnation is not None and owner is not None and owner != self.incarnation

    # -- store access ---------------------------------------------------------------------

    def _retried(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` with retries and exponential backoff: object stores fail transiently."""
        for attempt in range(1, self.attempts + 1):
            try:
                return call()
            except FileNotFoundError:
                raise  # an answer, not a transient failure
            except Exception as error:  # network and S3 errors come in many types
                if attempt == self.attempts:
                    raise
                delay = self.backoff_s * 2 ** (attempt - 1)
                log_event(
                    log,
                    "store_retry",
                    level=logging.WARNING,
                    key=what,
                    attempt=attempt,
                    retry_s=delay,
                    error=repr(error)[:300],
                )
                time.sleep(delay)

    def _put(self, key: str, data: bytes, store: ObjectStore | None = None) -> None:
        self._check_fence()
        self._retried(key, lambda: (store or self.store).put(key, data))

    def _delete(self, keys: list[str], store: ObjectStore) -> None:
        if keys:
            self._check_fence()
            self._retried(keys[0], lambda: store.delete(keys))

    # -- fencing --------------------------------------------------------------------------

    @property
    def _fence_key(self) -> str:
        return f"{self.run_id}/{FENCE}"

    def stored_fence(self) -> int:
        """The highest lease epoch that claimed this prefix on the primary store; 0 when none did."""
        try:
            data = self._retried(self._fence_key, lambda: self.store.get(self._fence_key))
        except FileNotFoundError:
            return 0
        return int(json.loads(data)["epoch"])

    def claim_fence(self, epoch: int, holder: str) -> None:
        """Make ``epoch`` this prefix's fence: from then on every write of a lower epoch is refused (FencedOut).

        Raises FencedOut when the store already names a higher epoch. Written before anything else the trainer
        writes, so a successor's first write is its claim."""
        self.epoch = epoch
        self._check_fence()
        note = json.dumps({"epoch": epoch, "holder": holder, "time": time.time()}).encode()
        self._retried(self._fence_key, lambda: self.store.put(self._fence_key, note))

    def _check_fence(self) -> None:
        """Refuse a write when the store's fence is above this writer's epoch (a successor took the run over).

        Checked on the store before each write, not from the writer's belief. Object stores offer no
        compare-and-set everywhere, so the check and the write are two requests: a writer paused between them
        can still land that one write; every later one is refused."""
        if self.guard is not None:
            self.guard()
        if self.epoch is None:
            return
        stored = self.stored_fence()
        if stored > self.epoch:
            log_event(log, "fenced_out", level=logging.CRITICAL, alert=True, epoch=self.epoch, fence=stored)
            raise FencedOut(
                f"a trainer of lease epoch {stored} took over run {self.run_id}; this one (epoch {self.epoch}) "
                f"writes nothing more to {self.location()}"
            )

    def _prefix(self, step: int) -> str:
        return f"{self.run_id}/step-{step:08d}/"

    def _listing(self, store: ObjectStore | None = None) -> dict[int, set[str]]:
        """Step -> which of manifest, STABLE and ABANDONED it has."""
        found: dict[int, set[str]] = {}
        for key in (store or self.store).list(f"{self.run_id}/step-"):
            match = _STEP_FILE.search(key)
            if match:
                found.setdefault(int(match.group(1)), set()).add(match.group(2))
        return found

    def _scan(self, store: ObjectStore | None = None, manifests: bool = True) -> list[_Stored]:
        """The steps with a manifest on ``store``, oldest first; with ``manifests``, each with its manifest read.

        A step pruned between the listing and the read of its manifest is left out."""
        store = store or self.store
        entries = []
        for step, names in sorted(self._listing(store).items()):
            if MANIFEST not in names:
                continue
            manifest = None
            if manifests:
                try:
                    manifest = _read_manifest(store.get(self._prefix(step) + MANIFEST))
                except FileNotFoundError:
                    continue
            entries.append(_Stored(step, names, manifest))
        return entries

    # -- saving -----------------------------------------------------------------------------

    def save(self, ckpt: Checkpoint, model_dir: Path) -> str:
        """Store ``ckpt`` (see the module docstring for the order of writes); returns the step's location.

        Raises RuntimeError before the store has an incarnation, ValueError when the state names
        another one, ForeignCheckpoints when another incarnation holds the step, and the store's
        error when the primary copy cannot be written. Pruning and mirror failures are only logged.
        """
        if self.incarnation is None:
            raise RuntimeError("checkpoint store has no incarnation yet: start_fresh() or adopt_incarnation() first")
        if ckpt.state.incarnation != self.incarnation:
            raise ValueError(
                f"step {ckpt.step}: its state names incarnation {ckpt.state.incarnation!r}, "
                f"the store writes for {self.incarnation!r}"
            )
        broken = non_finite([*ckpt.model.items(), *(ckpt.critic or {}).items()])
        if broken:  # a resume or rollback to it would bring the NaN back
            raise NonFiniteWeights(f"step {ckpt.step} is not saved: NaN or inf in {', '.join(broken[:3])}")
        parts = {
            "model.safetensors": save_safetensors(untied(ckpt.model)),
            "optimizer.pt": _torch_bytes(ckpt.optimizer),
            "scheduler.pt": _torch_bytes(ckpt.scheduler),
            "rng.pt": _rng_bytes(ckpt.rng),
            "trainer_state.json": ckpt.state.to_json().encode(),
            "lineage.jsonl": ckpt.lineage.encode(),
        }
        if ckpt.critic is not None:
            parts["critic.safetensors"] = save_safetensors(untied(ckpt.critic))
        parts |= {name: (model_dir / name).read_bytes() for name in MODEL_SIDECARS if (model_dir / name).is_file()}
        parts |= ckpt.extras or {}
        manifest = {
            "step": ckpt.step,
            "incarnation": self.incarnation,
            "fence_epoch": self.epoch,  # the lease epoch that wrote it (None: a writer without a lease)
            "format": CHECKPOINT_FORMAT,
            "policy_version": ckpt.state.policy_version,
            "version_high_water": max(ckpt.state.version_high_water, ckpt.state.policy_version),
            "last_experience_seq": ckpt.state.last_experience_seq,
            # Adapters only (model.lora): the base they were trained over, for whoever restores or exports them.
            "base_model": {"path": ckpt.state.base_model_path, "sha256": ckpt.state.base_model_sha256}
            if ckpt.state.base_model_sha256
            else None,
            "created": time.time(),
            "files": {name: {"size": len(data), "sha256": _sha256(data)} for name, data in parts.items()},
        }
        stable = self._write_step(self.store, ckpt.step, parts, manifest, stable=False)
        # From here the step is stored: what follows is housekeeping that the next save redoes.
        try:
            self._prune(self.store)
        except Exception as error:
            log_event(log, "prune_failed", level=logging.WARNING, step=ckpt.step, error=repr(error)[:300])
        if self.mirror is not None:
            try:
                self._write_step(self.mirror, ckpt.step, parts, manifest, stable=stable)
                self._prune(self.mirror)
            except Exception as error:  # the primary copy stands; the mirror catches up at the next save
                log_event(log, "mirror_failed", level=logging.WARNING, step=ckpt.step, error=repr(error)[:300])
        return f"{self.store.url.rstrip('/')}/{self._prefix(ckpt.step)}"

    def _write_step(
        self, store: ObjectStore, step: int, parts: dict[str, bytes], manifest: dict[str, Any], stable: bool
    ) -> bool:
        """Put one step on ``store`` so that no reader ever meets a mix of two copies; returns whether it is STABLE.

        ``stable``: mark the new copy STABLE (the mirror follows the primary's mark)."""
        prefix = self._prefix(step)
        names = {key[len(prefix) :] for key in self._retried(prefix, lambda: store.list(prefix))}
        old: dict[str, Any] | None = None
        if MANIFEST in names:
            try:
                old = _read_manifest(self._retried(prefix + MANIFEST, lambda: store.get(prefix + MANIFEST))) or {}
            except FileNotFoundError:
                names.discard(MANIFEST)  # pruned since the listing: what is left are stale parts
        if old is not None:
            owner = old.get("incarnation")
            if owner is not None and owner != self.incarnation:
                found = {self.location(store): [step]}
                raise ForeignCheckpoints(
                    f"{store.url.rstrip('/')}/{prefix} holds step {step} of another run incarnation ({owner}); "
                    f"not overwriting it. Continue that run with `rlpipe run --resume`, or use another run_id.",
                    found,
                )
            same = all(old.get(key) == manifest[key] for key in ("step", "policy_version", "last_experience_seq"))
            if same and ABANDONED not in names:
                if stable and STABLE not in names:
                    self._put(prefix + STABLE, _note(), store)
                return stable or STABLE in names  # saved already: the stored copy stands
            if ABANDONED not in names:
                # Another branch's live copy: disown it before touching a part, so readers skip it from now on.
                log_event(
                    log,
                    "checkpoint_replaced",
                    level=logging.WARNING,
                    step=step,
                    store=store.url,
                    policy_version=old.get("policy_version"),
                    new_policy_version=manifest["policy_version"],
                )
                self._put(prefix + ABANDONED, _note(), store)
                names.add(ABANDONED)
        keep = set(parts) | {MANIFEST, ABANDONED} | ({STABLE} if stable else set())
        # A step without a manifest, or an abandoned one, may lose parts: no reader uses them.
        self._delete(sorted(prefix + name for name in names - keep), store)
        for name, data in parts.items():
            self._put(prefix + name, data, store)
        self._put(prefix + MANIFEST, json.dumps(manifest, indent=2).encode(), store)
        if stable:
            self._put(prefix + STABLE, _note(), store)
        if ABANDONED in names:
            self._delete([prefix + ABANDONED], store)  # last: the new copy exists from here
        return stable

    def _prune(self, store: ObjectStore) -> None:
        """Keep the newest ``keep_last`` live steps and every stable one; abandoned steps go first.

        Foreign steps are not this run's to delete: they stay."""
        own = [entry for entry in self._scan(store) if not self._foreign(entry)]
        live = [entry.step for entry in own if entry.live]
        keep = set(live[-self.keep_last :]) | {entry.step for entry in own if STABLE in entry.names and entry.live}
        for entry in own:
            if entry.step not in keep:
                prefix = self._prefix(entry.step)
                self._delete([prefix + MANIFEST], store)  # first: the step is gone at once, never half-deleted
                self._retried(prefix, lambda prefix=prefix: store.delete_prefix(prefix))

    # -- reading ------------------------------------------------------------------------------

    def steps(
        self, store: ObjectStore | None = None, include_abandoned: bool = False, include_foreign: bool = False
    ) -> list[int]:
        """Steps that have a manifest, oldest first; this incarnation's only, unless ``include_foreign``."""
        check_owner = self.incarnation is not None and not include_foreign
        return [
            entry.step
            for entry in self._scan(store, manifests=check_owner)
            if (include_abandoned or entry.live) and not (check_owner and self._foreign(entry))
        ]

    def catalog(self, include_foreign: bool = False) -> list[dict[str, Any]]:
        """Every stored step of this incarnation (and of others with ``include_foreign``) with its markers,
        size, policy version and incarnation, oldest first. A step whose manifest cannot be read is left out."""
        entries = []
        for entry in self._scan():
            if entry.manifest is None:
                log_event(
                    log, "checkpoint_skipped", level=logging.WARNING, step=entry.step, reason="unreadable manifest"
                )
                continue
            foreign = self._foreign(entry)
            if foreign and not include_foreign:
                continue
            manifest = entry.manifest
            entries.append(
                {
                    "step": entry.step,
                    "policy_version": manifest.get("policy_version") or 0,
                    "last_experience_seq": manifest.get("last_experience_seq"),
                    "created": manifest["created"],
                    "bytes": sum(meta["size"] for meta in manifest["files"].values()),
                    "stable": STABLE in entry.names,
                    "abandoned": ABANDONED in entry.names,
                    "incarnation": entry.owner,
                    "foreign": foreign,
                    "location": f"{self.store.url.rstrip('/')}/{self._prefix(entry.step)}",
                }
            )
        return entries

    def mark(self, step: int, marker: str) -> None:
        """Put ``marker`` (STABLE or ABANDONED) beside the manifest of ``step``; on the mirror too if it has it."""
        if marker not in (STABLE, ABANDONED):
            raise ValueError(f"unknown marker {marker!r}: {STABLE} or {ABANDONED}")
        entry = next((e for e in self._scan(manifests=self.incarnation is not None) if e.step == step), None)
        if entry is None:
            raise KeyError(f"no checkpoint at step {step} (stored: {self.steps()})")
        if self._foreign(entry):
            raise KeyError(f"step {step} belongs to another run incarnation ({entry.owner}), not to this one")
        if marker == STABLE and not entry.live:
            raise AbandonedStep(
                f"step {step} was abandoned by a rollback and cannot be marked stable (live steps: {self.steps()})"
            )
        note = _note()
        self._put(self._prefix(step) + marker, note)
        if self.mirror is not None:
            try:
                if step in self.steps(self.mirror, include_abandoned=True):
                    self._put(self._prefix(step) + marker, note, self.mirror)
            except Exception as error:  # the primary holds the truth
                log_event(log, "mirror_failed", level=logging.WARNING, step=step, error=repr(error)[:300])

    def abandon_after(self, step: int) -> list[int]:
        """Mark every live step of this incarnation after ``step`` ABANDONED, on the mirror too; returns the
        steps it marked on the primary store (none when run again: it is idempotent).

        For a resume from an older step and for a rollback, before any in-memory state changes:
        if it raises (the primary could not be marked), nothing else has changed and it can be
        run again. Newest first, so an interrupted call leaves the live steps one unbroken branch
        from the oldest. The mirror's failures are logged: the primary holds the truth.
        """
        marked = self._abandon_after(self.store, step)
        if self.mirror is not None:
            try:
                self._abandon_after(self.mirror, step)
            except Exception as error:
                log_event(log, "mirror_failed", level=logging.WARNING, step=step, error=repr(error)[:300])
        if marked:
            log_event(log, "checkpoints_abandoned", after_step=step, steps=marked)
        return marked

    def _abandon_after(self, store: ObjectStore, step: int) -> list[int]:
        entries = self._retried(self.run_id, lambda: self._scan(store, manifests=self.incarnation is not None))
        later = [e.step for e in entries if e.step > step and e.live and not self._foreign(e)]
        for later_step in sorted(later, reverse=True):
            self._put(self._prefix(later_step) + ABANDONED, _note(), store)
        return sorted(later)

    def replay_floor(self, read_seq: int) -> int | None:
        """The EXPERIENCE sequence at and below which nothing is ever read again, never above ``read_seq`` (what the
        trainer has read): the lowest sequence applied by the newest ``keep_last`` live steps of this incarnation,
        the ones a resume or a rollback within the kept window reads on from; ``read_seq`` when there are none.

        A STABLE step older than that window does not hold EXPERIENCE back (a run would keep its stream forever): a
        rollback to it reads on from the purge (``purged_through``). None when a step of the window has no known
        sequence."""
        window = [entry for entry in self._scan() if entry.live and not self._foreign(entry)][-self.keep_last :]
        seqs = [entry.manifest.get("last_experience_seq") if entry.manifest is not None else None for entry in window]
        if None in seqs:
            return None
        return min([*seqs, read_seq])

    def record_purge(self, seq: int, stream: str) -> None:
        """Note, before EXPERIENCE is purged through ``seq``, that this run purges it: a resume or rollback to a step
        that read less then reads on after ``seq`` instead of taking the gap for a broker that lost messages.

        ``stream`` names the stream's life (its creation time): a stream re-created since voids the note. Written to
        the mirror too, as a checkpoint is, so that a resume from the mirror knows it."""
        data = json.dumps({"experience_seq": seq, "stream": stream}).encode()
        self._put(self._purge_key, data)
        if self.mirror is not None:
            try:
                self._put(self._purge_key, data, self.mirror)
            except Exception as error:  # the primary holds the truth
                log_event(log, "mirror_failed", level=logging.WARNING, key=self._purge_key, error=repr(error)[:300])

    def purged_through(self, stream: str) -> int:
        """The EXPERIENCE sequence through which this run purged ``stream`` (its life as in ``record_purge``);
        0 when it never did. Read from the primary store, or from the mirror while the primary is unreachable."""
        stores = [self.store] if self.mirror is None else [self.store, self.mirror]
        for store in stores:
            try:
                data = self._retried(self._purge_key, lambda store=store: store.get(self._purge_key))
            except FileNotFoundError:
                return 0
            except Exception:
                if store is stores[-1]:
                    raise
                continue
            record = json.loads(data)
            return int(record["experience_seq"]) if record.get("stream") == stream else 0
        return 0

    @property
    def _purge_key(self) -> str:
        return f"{self.run_id}/{PURGED}"

    def latest_stable(self) -> int | None:
        """The newest live STABLE step of this incarnation."""
        entries = self._scan(manifests=self.incarnation is not None)
        stable = [e.step for e in entries if STABLE in e.names and e.live and not self._foreign(e)]
        return max(stable, default=None)

    def load(self, step: int, store: ObjectStore | None = None) -> Checkpoint:
        """Step ``step`` from ``store``; without one, from the primary store or else the mirror.

        Raises CheckpointCorrupt when a part does not match its manifest, FileNotFoundError when
        the step is not there, ForeignCheckpoints when it is another incarnation's."""
        if store is None:
            if self.mirror is None:
                return self.load(step, self.store)
            try:
                return self.load(step, self.store)
            except UNREADABLE as error:
                log_event(
                    log, "checkpoint_skipped", level=logging.WARNING, step=step, store=self.store.url, reason=str(error)
                )
                return self.load(step, self.mirror)
        prefix = self._prefix(step)
        manifest = _read_manifest(store.get(prefix + MANIFEST))
        if manifest is None:
            raise CheckpointCorrupt(f"step {step}: manifest.json is not a manifest")
        if self._foreign(_Stored(step, {MANIFEST}, manifest)):
            raise ForeignCheckpoints(
                f"step {step} at {store.url.rstrip('/')}/{prefix} belongs to another run incarnation "
                f"({manifest['incarnation']}), not to {self.incarnation}",
                {self.location(store): [step]},
            )
        written = manifest.get("format", 1)
        if not isinstance(written, int) or written > CHECKPOINT_FORMAT:
            raise UnknownCheckpointFormat(
                f"step {step} at {store.url.rstrip('/')}/{prefix} is in checkpoint format {written!r}, written by a "
                f"newer rlpipe; this one reads formats 1 to {CHECKPOINT_FORMAT}. Resume with that rlpipe, or name an "
                "older step (checkpoint.resume_step)"
            )
        missing = [name for name in REQUIRED_PARTS if name not in manifest["files"]]
        if missing:
            raise CheckpointCorrupt(f"step {step} (checkpoint format {written}): its manifest lists no {missing}")
        parts = {}
        for name, meta in manifest["files"].items():
            data = store.get(prefix + name)
            if len(data) != meta["size"] or _sha256(data) != meta["sha256"]:
                raise CheckpointCorrupt(f"step {step}: {name} does not match its manifest hash")
            parts[name] = data
        if "rng.pt" not in parts and "rng.pkl" in parts:
            raise UnsafeCheckpoint(
                f"step {step}: rng.pkl is a Python pickle (a checkpoint written before rlpipe stopped unpickling), "
                "refused unopened; resume from a newer step or start afresh"
            )
        return Checkpoint(
            step=step,
            model=load_safetensors(parts["model.safetensors"]),
            optimizer=_safe_torch_load(parts["optimizer.pt"], f"step {step}: optimizer.pt"),
            scheduler=_safe_torch_load(parts["scheduler.pt"], f"step {step}: scheduler.pt"),
            rng=_rng_from_bytes(parts["rng.pt"], f"step {step}: rng.pt"),
            state=TrainerState.from_json(parts["trainer_state.json"]),
            critic=load_safetensors(parts["critic.safetensors"]) if "critic.safetensors" in parts else None,
            lineage=parts["lineage.jsonl"].decode(),
        )

    def load_latest(self, saved_step: int | None = None) -> Checkpoint | None:
        """The newest live step of this incarnation (of any, before it has one) whose parts all match its
        manifest, from the store or else its mirror; None when the run has never saved. See ``load_newest``."""
        return self.load_newest(saved_step).checkpoint

    def load_newest(self, saved_step: int | None = None) -> Resumable:
        """The newest loadable live step, and the newer steps passed over because a copy was corrupt.

        ``saved_step``: the step the run's own record says it saved last. Listing is retried with backoff; a
        store that still cannot be listed is never taken for an empty one (``resume_candidates`` raises
        StoreUnreadable or CheckpointsMissing). A step in an unknown format raises UnknownCheckpointFormat."""
        listings = []
        for store in (self.store, self.mirror):
            if store is None:
                continue
            try:
                listings.append(StoreListing(store.url, self._retried(self.run_id, lambda s=store: self.steps(s))))
            except Exception as error:  # the store's many failure types: it may hold steps all the same
                log_event(log, "store_unreadable", level=logging.WARNING, store=store.url, reason=repr(error)[:300])
                listings.append(StoreListing(store.url, None, repr(error)[:300]))
        stores = {store.url: store for store in (self.store, self.mirror) if store is not None}
        by_step: dict[int, list[str]] = {}
        for step, url in resume_candidates(listings, saved_step):
            by_step.setdefault(step, []).append(url)
        skipped: dict[int, str] = {}
        for step, urls in by_step.items():  # newest first
            unreachable = []
            for url in urls:
                try:
                    return Resumable(self.load(step, stores[url]), skipped)
                except UNREADABLE as error:  # this copy is bad: another copy, or an older step, may do
                    skipped[step] = f"{url}: {error}"[:500]
                    log_event(log, "checkpoint_skipped", level=logging.WARNING, step=step, store=url, reason=str(error))
                except (UnknownCheckpointFormat, ForeignCheckpoints):
                    raise
                except Exception as error:  # the store failed mid-read: the step may be whole
                    unreachable.append(f"{url}: {error!r}"[:300])
            if unreachable:
                raise StoreUnreadable(f"cannot read step {step} ({'; '.join(unreachable)})")
        if by_step:  # the run saved, and no copy of any step loads: never a reason to start from base weights
            why = "; ".join(f"step {step}: {reason}" for step, reason in skipped.items())
            expected = f"; this run's record says it saved step {saved_step}" if saved_step is not None else ""
            raise CheckpointsMissing(f"no stored step of this run loads ({why}){expected}")
        return Resumable(None, skipped)

    def version_high_water(self) -> int:
        """The highest policy version any stored step of this incarnation (abandoned ones too) says was served."""
        return max(
            (
                max(int(entry.manifest.get("version_high_water") or 0), int(entry.manifest.get("policy_version") or 0))
                for entry in self._retried(self.run_id, self._scan)
                if entry.manifest is not None and not self._foreign(entry)
            ),
            default=0,
        )


def _note() -> bytes:
    """A marker's content: when it was put."""
    return json.dumps({"time": time.time()}).encode()
