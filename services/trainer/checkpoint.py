"""Trainer checkpoints at ``<store>/<run>/step-<N>/``.

Parts go up first (model as safetensors with its HF config and tokenizer, so a
step folder is itself a loadable model; the PPO critic; optimizer; LR scheduler; RNG states; trainer state; lineage),
then ``manifest.json`` with every part's size and sha256. A step without a
manifest, or whose parts do not match it, does not exist for loaders.

Two marker objects sit beside a manifest: ``STABLE`` (an operator or a healthy save
vouched for the step; pruning keeps it and ``rollback --stable`` goes to the newest)
and ``ABANDONED`` (a rollback went back before it; loaders skip it and pruning drops it
first, while lineage.jsonl keeps the record of what it trained).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from services.common.logs import log_event
from services.common.storage import ObjectStore

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STABLE = "STABLE"
ABANDONED = "ABANDONED"
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


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict without aliases of shared storage (tied embeddings), as Hugging Face saves it."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor.contiguous()
    return out


def detached_copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``module``'s state that training cannot change; tied tensors are copied (and stored) once."""
    return {name: tensor.detach().clone() for name, tensor in untied(module.state_dict()).items()}


def load_untied(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a state dict saved by ``untied``: only the aliases of shared tensors may be absent."""
    ptrs: dict[int, list[str]] = {}
    for name, tensor in module.state_dict().items():
        ptrs.setdefault(tensor.data_ptr(), []).append(name)
    aliases = {name for names in ptrs.values() for name in names[1:]}
    result = module.load_state_dict(state, strict=False)
    wrong = set(result.missing_keys) - aliases
    if wrong or result.unexpected_keys:
        raise ValueError(
            f"checkpoint does not fit the model: missing {sorted(wrong)}, unexpected {sorted(result.unexpected_keys)}"
        )


@dataclass
class Checkpoint:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    state: dict[str, Any]  # policy version, data cursor, last applied EXPERIENCE sequence, metrics
    critic: dict[str, torch.Tensor] | None = None
    lineage: str = ""  # lineage.jsonl up to this step
    extras: dict[str, bytes] | None = None  # kept for operators, not loaded: effective config, build info


class CheckpointCorrupt(RuntimeError):
    pass


class AbandonedStep(ValueError):
    pass


# What a stored copy that cannot be used raises: another copy or an older step may do.
UNREADABLE = (CheckpointCorrupt, OSError, KeyError, ValueError)


class CheckpointStore:
    def __init__(
        self,
        store: ObjectStore,
        run_id: str,
        keep_last: int,
        attempts: int = 4,
        backoff_s: float = 1.0,
        mirror: ObjectStore | None = None,
    ):
        self.store = store
        self.mirror = mirror
        self.run_id = run_id
        self.keep_last = keep_last
        self.attempts = attempts
        self.backoff_s = backoff_s

    def _retried(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` with retries and exponential backoff: object stores fail transiently."""
        for attempt in range(1, self.attempts + 1):
            try:
                return call()
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
        self._retried(key, lambda: (store or self.store).put(key, data))

    def _prefix(self, step: int) -> str:
        return f"{self.run_id}/step-{step:08d}/"

    def save(self, ckpt: Checkpoint, model_dir: Path) -> str:
        """Upload the parts, then the manifest; returns the step's location."""
        prefix = self._prefix(ckpt.step)
        earlier = self._retried(prefix, self._listing).get(ckpt.step, set())
        if earlier:
            self.store.delete_prefix(prefix)  # a step saved again, or an abandoned branch's step of the same number
        parts = {
            "model.safetensors": save_safetensors(untied(ckpt.model)),
            "optimizer.pt": _torch_bytes(ckpt.optimizer),
            "scheduler.pt": _torch_bytes(ckpt.scheduler),
            "rng.pkl": pickle.dumps(ckpt.rng),
            "trainer_state.json": json.dumps(ckpt.state, indent=2).encode(),
            "lineage.jsonl": ckpt.lineage.encode(),
        }
        if ckpt.critic is not None:
            parts["critic.safetensors"] = save_safetensors(untied(ckpt.critic))
        parts |= {name: (model_dir / name).read_bytes() for name in MODEL_SIDECARS if (model_dir / name).is_file()}
        parts |= ckpt.extras or {}
        manifest = {
            "step": ckpt.step,
            "policy_version": ckpt.state.get("policy_version"),
            "last_experience_seq": ckpt.state.get("last_experience_seq"),
            "created": time.time(),
            "files": {name: {"size": len(data), "sha256": _sha256(data)} for name, data in parts.items()},
        }
        parts[MANIFEST] = json.dumps(manifest, indent=2).encode()  # last: it makes the step exist
        if STABLE in earlier and ABANDONED not in earlier:
            parts[STABLE] = json.dumps({"time": time.time()}).encode()  # saving the step again keeps its mark
        for name, data in parts.items():
            self._put(prefix + name, data)
        self._prune(self.store)
        if self.mirror is not None:
            try:
                if earlier:  # the mirror's copy of the earlier save (maybe marked ABANDONED) goes too
                    self.mirror.delete_prefix(prefix)
                for name, data in parts.items():
                    self._put(prefix + name, data, self.mirror)
                self._prune(self.mirror)
            except Exception as error:  # the primary copy stands; the mirror catches up at the next save
                log_event(log, "mirror_failed", level=logging.WARNING, step=ckpt.step, error=repr(error)[:300])
        return f"{self.store.url.rstrip('/')}/{prefix}"

    def _listing(self, store: ObjectStore | None = None) -> dict[int, set[str]]:
        """Step -> which of manifest, STABLE and ABANDONED it has."""
        found: dict[int, set[str]] = {}
        for key in (store or self.store).list(f"{self.run_id}/step-"):
            match = _STEP_FILE.search(key)
            if match:
                found.setdefault(int(match.group(1)), set()).add(match.group(2))
        return found

    def steps(self, store: ObjectStore | None = None, include_abandoned: bool = False) -> list[int]:
        """Steps that have a manifest, oldest first."""
        listing = self._listing(store)
        return sorted(
            step
            for step, names in listing.items()
            if MANIFEST in names and (include_abandoned or ABANDONED not in names)
        )

    def catalog(self) -> list[dict[str, Any]]:
        """Every stored step with its markers, size and policy version, oldest first."""
        entries = []
        for step, names in sorted(self._listing().items()):
            if MANIFEST not in names:
                continue
            try:
                manifest = json.loads(self.store.get(self._prefix(step) + MANIFEST))
            except FileNotFoundError:
                continue  # pruned between the listing and this read
            entries.append(
                {
                    "step": step,
                    "policy_version": manifest.get("policy_version") or 0,
                    "last_experience_seq": manifest.get("last_experience_seq"),
                    "created": manifest["created"],
                    "bytes": sum(meta["size"] for meta in manifest["files"].values()),
                    "stable": STABLE in names,
                    "abandoned": ABANDONED in names,
                    "location": f"{self.store.url.rstrip('/')}/{self._prefix(step)}",
                }
            )
        return entries

    def mark(self, step: int, marker: str) -> None:
        """Put ``marker`` (STABLE or ABANDONED) beside the manifest of ``step``, on the mirror too when it has the step."""
        listing = self._listing()
        if MANIFEST not in listing.get(step, set()):
            raise KeyError(f"no checkpoint at step {step} (stored: {self.steps()})")
        if marker == STABLE and ABANDONED in listing[step]:
            raise AbandonedStep(
                f"step {step} was abandoned by a rollback and cannot be marked stable (live steps: {self.steps()})"
            )
        note = json.dumps({"time": time.time()}).encode()
        self._put(self._prefix(step) + marker, note)
        if self.mirror is not None:
            try:
                if step in self.steps(self.mirror, include_abandoned=True):
                    self._put(self._prefix(step) + marker, note, self.mirror)
            except Exception as error:  # the primary holds the truth
                log_event(log, "mirror_failed", level=logging.WARNING, step=step, error=repr(error)[:300])

    def replay_floor(self) -> int | None:
        """The lowest EXPERIENCE sequence any loadable step has applied: nothing at or below it is ever read again."""
        seqs = [entry["last_experience_seq"] for entry in self.catalog() if not entry["abandoned"]]
        return min(seqs) if seqs and None not in seqs else None

    def latest_stable(self) -> int | None:
        listing = self._listing()
        stable = [step for step, names in listing.items() if {MANIFEST, STABLE} <= names and ABANDONED not in names]
        return max(stable, default=None)

    def load(self, step: int, store: ObjectStore | None = None) -> Checkpoint:
        """Step ``step`` from ``store``; without one, from the primary store or else the mirror.

        Raises CheckpointCorrupt when a part does not match its manifest, FileNotFoundError when
        the step is not there."""
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
        manifest = json.loads(store.get(prefix + MANIFEST))
        parts = {}
        for name, meta in manifest["files"].items():
            data = store.get(prefix + name)
            if len(data) != meta["size"] or _sha256(data) != meta["sha256"]:
                raise CheckpointCorrupt(f"step {step}: {name} does not match its manifest hash")
            parts[name] = data
        return Checkpoint(
            step=step,
            model=load_safetensors(parts["model.safetensors"]),
            optimizer=torch.load(io.BytesIO(parts["optimizer.pt"]), weights_only=False),
            scheduler=torch.load(io.BytesIO(parts["scheduler.pt"]), weights_only=False),
            rng=pickle.loads(parts["rng.pkl"]),
            state=json.loads(parts["trainer_state.json"]),
            critic=load_safetensors(parts["critic.safetensors"]) if "critic.safetensors" in parts else None,
            lineage=parts["lineage.jsonl"].decode(),
        )

    def load_latest(self) -> Checkpoint | None:
        """The newest step whose parts all match its manifest, from the store or else its mirror.

        Corrupt or unreadable copies are skipped with a warning.
        """
        stores = [store for store in (self.store, self.mirror) if store is not None]
        listed: dict[int, list[ObjectStore]] = {}
        for store in stores:
            try:
                for step in self.steps(store):
                    listed.setdefault(step, []).append(store)
            except Exception as error:  # an unreachable store: the other one may do
                log_event(log, "store_unreadable", level=logging.WARNING, store=store.url, reason=repr(error)[:300])
        for step in sorted(listed, reverse=True):
            for store in listed[step]:
                try:
                    return self.load(step, store)
                except UNREADABLE as error:
                    log_event(
                        log, "checkpoint_skipped", level=logging.WARNING, step=step, store=store.url, reason=str(error)
                    )
        return None

    def _prune(self, store: ObjectStore) -> None:
        """Keep the newest ``keep_last`` live steps and every stable one; abandoned steps go first."""
        listing = self._listing(store)
        live = sorted(step for step, names in listing.items() if MANIFEST in names and ABANDONED not in names)
        keep = set(live[-self.keep_last :]) | {
            step for step, names in listing.items() if STABLE in names and ABANDONED not in names
        }
        for step, names in listing.items():
            if MANIFEST in names and step not in keep:
                store.delete_prefix(self._prefix(step))
