"""A step folder's format, ``<store>/<run>/step-<N>/``, as pure functions: bytes in, bytes out (``checkpoint.py`` does
the store I/O).

Parts (model as safetensors with its HF config and tokenizer, so a step folder is itself a loadable model; the PPO
critic; optimizer; LR scheduler; RNG states; trainer state; lineage) are listed in ``manifest.json`` with each one's
size and sha256. Nothing is unpickled on load: weights are safetensors, the optimizer, scheduler and RNG states load
with ``torch.load(weights_only=True)`` (tensors, numbers, strings and containers only), and a part holding any other
object is refused with ``UnsafeCheckpoint``. A step without a manifest, or whose parts do not match it, does not
exist for loaders. The manifest names its ``format`` (``CHECKPOINT_FORMAT``): a step of a newer format is refused by
name (``UnknownCheckpointFormat``), one without the field is read as format 1.

Two marker objects sit beside a manifest: ``STABLE`` (an operator or a healthy save vouched for the step; pruning
keeps it and ``rollback --stable`` goes to the newest) and ``ABANDONED`` (a rollback or a resume went back before it;
loaders skip it and pruning drops it first, while lineage.jsonl keeps the record of what it trained).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from services.trainer.checkpointing import codec
from services.trainer.checkpointing.state import Checkpoint, CheckpointCorrupt, TrainerState, UnsafeCheckpoint, untied

MANIFEST = "manifest.json"
# The layout of a step folder. 1: written before the manifest named its format (read as such: trainer_state.json
# fields added since default, and a pickled rng.pkl is refused by name). 2: every part. 3: optimizer.pt may be absent
# (checkpoint.optimizer_every) and the weights may be in the serving dtype (trainer_state.json's weights_dtype).
# 4: parts may be stored compressed (their manifest entries name the codec, codec.py).
# A step is written in the oldest format that holds it, so an older rlpipe still resumes a full step. A step of a
# newer format is refused by name, never skipped for an older step: that would silently abandon its training.
CHECKPOINT_FORMAT = 4
COMPRESSED_FORMAT = 4
FULL_FORMAT = 2  # every part, weights in the master dtype
PARTIAL_FORMAT = 3  # no optimizer state, or weights in the serving dtype
REQUIRED_PARTS = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "lineage.jsonl")
OPTIMIZER = "optimizer.pt"
OPTIONAL_FROM_FORMAT_3 = (OPTIMIZER,)
STABLE = "STABLE"
ABANDONED = "ABANDONED"
PURGED = "experience-purged.json"  # beside the step folders: how far this run purged EXPERIENCE (record_purge)
FENCE = "FENCE"  # beside the step folders: the highest lease epoch that claimed this prefix (claim_fence)
STEP_FILE = re.compile(r"step-(\d+)/(manifest\.json|STABLE|ABANDONED)$")
MODEL_SIDECARS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


class UnknownCheckpointFormat(RuntimeError):
    """A step written in a format this rlpipe does not read (a newer rlpipe's): refused by name, never skipped."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def step_prefix(run_id: str, step: int) -> str:
    return f"{run_id}/step-{step:08d}/"


def marker_note() -> bytes:
    """A marker's content: when it was put."""
    return json.dumps({"time": time.time()}).encode()


@dataclass(frozen=True)
class PartMeta:
    """A stored object of a step: its size and sha256 as stored; a compressed part also names its codec
    (``codec.Codec.name``) and its size before compression."""

    size: int
    sha256: str
    codec: str = ""  # "": stored as it is
    raw_size: int | None = None

    @classmethod
    def parse(cls, meta: dict[str, Any]) -> PartMeta:
        raw_size = meta.get("raw_size")
        return cls(
            int(meta["size"]),
            str(meta["sha256"]),
            str(meta.get("codec") or ""),
            None if raw_size is None else int(raw_size),
        )

    def to_json(self) -> dict[str, Any]:
        plain = {"size": self.size, "sha256": self.sha256}
        return plain if not self.codec else {**plain, "codec": self.codec, "raw_size": self.raw_size}


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """``manifest.json``: which parts make up the step, and what a listing needs to know without opening them."""

    step: int
    files: dict[str, PartMeta]
    created: float  # unix time of the save
    incarnation: str | None = None  # None: written before incarnations (it belongs to whoever resumes it)
    fence_epoch: int | None = None  # the lease epoch that wrote it (None: a writer without a lease)
    format: int | str = 1  # a str: a value that is no format number, refused as an unknown format
    policy_version: int = 0
    version_high_water: int = 0  # the highest policy version served by the time of the save
    last_experience_seq: int | None = None  # None: not recorded, so the replay floor is unknown
    # The model the run started from (model.lora: the base the adapters sit on), {"path", "sha256"}; None in a
    # full-weight step saved before the hash was recorded.
    base_model: dict[str, str] | None = None

    @classmethod
    def parse(cls, data: bytes) -> Manifest | None:
        """The manifest in ``data``, or None when it is not one (bitrot): whose step it is cannot be told then."""
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict):
                return None
            written = raw.get("format", 1)
            seq = raw.get("last_experience_seq")
            return cls(
                step=int(raw["step"]),
                files={name: PartMeta.parse(meta) for name, meta in raw["files"].items()},
                created=float(raw["created"]),
                incarnation=raw.get("incarnation"),
                fence_epoch=raw.get("fence_epoch"),
                format=written if isinstance(written, int) and not isinstance(written, bool) else repr(written),
                policy_version=int(raw.get("policy_version") or 0),
                version_high_water=int(raw.get("version_high_water") or 0),
                last_experience_seq=None if seq is None else int(seq),
                base_model=raw.get("base_model"),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def to_bytes(self) -> bytes:
        fields = asdict(self)
        fields["files"] = {name: meta.to_json() for name, meta in self.files.items()}
        return json.dumps(fields, indent=2).encode()

    @property
    def parts(self) -> set[str]:
        """The parts the step holds, by the names they have once read back (``model.safetensors``, not the
        ``model.safetensors.zlib`` a compressed one is stored as)."""
        return {name.removesuffix(codec.SUFFIX) if meta.codec else name for name, meta in self.files.items()}

    @property
    def size(self) -> int:
        return sum(meta.size for meta in self.files.values())

    def same_save(self, other: Manifest) -> bool:
        """Whether ``other`` stores the same state (a retried save of one step), not another branch's."""
        return (self.step, self.policy_version, self.last_experience_seq) == (
            other.step,
            other.policy_version,
            other.last_experience_seq,
        )

    def with_optimizer_of(self, other: Manifest) -> Manifest | None:
        """This manifest with the optimizer state of ``other``, a manifest of the same save (``same_save``) that
        holds it where this one does not; None when there is nothing to add. Every other part stays this one's
        (what a reader of this copy already loads), so only the optimizer part and the manifest are written. The
        format is the higher of the two: each reads a step with or without the part."""
        if OPTIMIZER in self.parts or OPTIMIZER not in other.parts:
            return None
        added = {name: meta for name, meta in other.files.items() if name.removesuffix(codec.SUFFIX) == OPTIMIZER}
        written = max(fmt for fmt in (self.format, other.format) if isinstance(fmt, int))
        return replace(self, files={**self.files, **added}, format=written)

    def check_readable(self, where: str) -> None:
        """Raise UnknownCheckpointFormat for a newer format, CheckpointCorrupt when a required part is not listed."""
        if not isinstance(self.format, int) or self.format > CHECKPOINT_FORMAT:
            raise UnknownCheckpointFormat(
                f"step {self.step} at {where} is in checkpoint format {self.format}, written by a newer rlpipe; "
                f"this one reads formats 1 to {CHECKPOINT_FORMAT}. Resume with that rlpipe, or name an older step "
                "(checkpoint.resume_step)"
            )
        optional = OPTIONAL_FROM_FORMAT_3 if self.format >= 3 else ()
        missing = [name for name in REQUIRED_PARTS if name not in self.parts and name not in optional]
        if missing:
            raise CheckpointCorrupt(
                f"step {self.step} (checkpoint format {self.format}): its manifest lists no {missing}"
            )

    def verify(self, name: str, data: bytes) -> None:
        """Raise CheckpointCorrupt unless ``data`` is part ``name`` as the manifest lists it."""
        meta = self.files[name]
        if len(data) != meta.size or sha256(data) != meta.sha256:
            raise CheckpointCorrupt(f"step {self.step}: {name} does not match its manifest hash")

    def read_back(self, stored: dict[str, bytes]) -> dict[str, bytes]:
        """The parts as they were before storing: each compressed one (verified already) inflated under its own
        name. CheckpointCorrupt when one names a codec this rlpipe does not read or does not inflate to its
        recorded size."""
        parts = {}
        for name, data in stored.items():
            meta = self.files[name]
            if not meta.codec:
                parts[name] = data
                continue
            try:
                how = codec.Codec.parse(meta.codec)
                parts[name.removesuffix(codec.SUFFIX)] = codec.decompress(data, how, meta.raw_size or 0)
            except ValueError as error:  # UnknownCodec too
                raise CheckpointCorrupt(f"step {self.step}: {name}: {error}") from None
        return parts


@dataclass(frozen=True)
class StoredStep:
    """One step on one store, as a listing and its manifest show it."""

    step: int
    names: frozenset[str]  # which of manifest.json, STABLE and ABANDONED it has
    manifest: Manifest | None  # None: not read, or unreadable

    @property
    def owner(self) -> str | None:
        return self.manifest.incarnation if self.manifest is not None else None

    @property
    def live(self) -> bool:
        return ABANDONED not in self.names


@dataclass(frozen=True)
class CatalogEntry:
    """A stored step as operators see it (``rlpipe checkpoints``, the Admin API)."""

    step: int
    policy_version: int
    last_experience_seq: int | None
    created: float
    bytes: int
    stable: bool
    abandoned: bool
    incarnation: str | None
    foreign: bool  # another run incarnation's
    location: str


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


def encode_parts(ckpt: Checkpoint, sidecars: dict[str, bytes]) -> dict[str, bytes]:
    """Every part of ``ckpt``'s step folder; ``sidecars``: the model folder's files that make it loadable."""
    parts = {
        "model.safetensors": save_safetensors(untied(ckpt.model)),
        **({"optimizer.pt": _torch_bytes(ckpt.optimizer)} if ckpt.optimizer is not None else {}),
        "scheduler.pt": _torch_bytes(ckpt.scheduler),
        "rng.pt": _rng_bytes(ckpt.rng),
        "trainer_state.json": ckpt.state.to_json().encode(),
        "lineage.jsonl": ckpt.lineage.encode(),
    }
    if ckpt.critic is not None:
        parts["critic.safetensors"] = save_safetensors(untied(ckpt.critic))
    return parts | sidecars | (ckpt.extras or {})


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested state (an optimizer's ``state_dict()``)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def compress_parts(ckpt: Checkpoint, parts: dict[str, bytes]) -> tuple[dict[str, bytes], dict[str, PartMeta]]:
    """``parts`` as stored with ``checkpoint.compression: zlib``: the weights and the optimizer state compressed
    (``codec``), each shuffled by the element size of most of its tensors, under ``name + codec.SUFFIX``; the
    others as they are. Returns the stored objects and the manifest entries of the compressed ones."""
    sources = {"model.safetensors": ckpt.model, "critic.safetensors": ckpt.critic, "optimizer.pt": ckpt.optimizer}
    stored, metas = dict(parts), {}
    for name in codec.COMPRESSIBLE:
        if name not in parts:
            continue
        how = codec.Codec(codec.lane_of(_tensors(sources[name])))
        data = codec.compress(parts[name], how)
        del stored[name]
        stored[name + codec.SUFFIX] = data
        metas[name + codec.SUFFIX] = PartMeta(len(data), sha256(data), how.name, len(parts[name]))
    return stored, metas


def describe(
    ckpt: Checkpoint,
    parts: dict[str, bytes],
    incarnation: str,
    fence_epoch: int | None,
    compressed: dict[str, PartMeta] | None = None,
) -> Manifest:
    """The manifest of the stored objects ``parts``, saved by ``incarnation`` holding lease epoch ``fence_epoch``;
    ``compressed``: the entries of those stored compressed (``compress_parts``)."""
    state = ckpt.state
    compressed = compressed or {}
    if compressed:
        written = COMPRESSED_FORMAT
    else:
        written = FULL_FORMAT if ckpt.optimizer is not None and not state.weights_dtype else PARTIAL_FORMAT
    return Manifest(
        step=ckpt.step,
        incarnation=incarnation,
        fence_epoch=fence_epoch,
        format=written,
        policy_version=state.policy_version,
        version_high_water=max(state.version_high_water, state.policy_version),
        last_experience_seq=state.last_experience_seq,
        base_model={"path": state.base_model_path, "sha256": state.base_model_sha256}
        if state.base_model_sha256
        else None,
        created=time.time(),
        files={name: compressed.get(name) or PartMeta(len(data), sha256(data)) for name, data in parts.items()},
    )


def decode_checkpoint(step: int, parts: dict[str, bytes]) -> Checkpoint:
    """The checkpoint in ``parts`` (verified against their manifest); UnsafeCheckpoint for a part it refuses."""
    if "rng.pt" not in parts and "rng.pkl" in parts:
        raise UnsafeCheckpoint(
            f"step {step}: rng.pkl is a Python pickle (a checkpoint written before rlpipe stopped unpickling), "
            "refused unopened; resume from a newer step or start afresh"
        )
    return Checkpoint(
        step=step,
        model=load_safetensors(parts["model.safetensors"]),
        optimizer=_safe_torch_load(parts["optimizer.pt"], f"step {step}: optimizer.pt")
        if "optimizer.pt" in parts
        else None,
        scheduler=_safe_torch_load(parts["scheduler.pt"], f"step {step}: scheduler.pt"),
        rng=_rng_from_bytes(parts["rng.pt"], f"step {step}: rng.pt"),
        state=TrainerState.from_json(parts["trainer_state.json"]),
        critic=load_safetensors(parts["critic.safetensors"]) if "critic.safetensors" in parts else None,
        lineage=parts["lineage.jsonl"].decode(),
    )
