"""Wire schema of the messages that flow between stages.

A message is a msgpack map with a schema version ``v``. A *group* (one prompt and
its n completions) is the unit that flows; each stage adds its part:

    prompt     -> Prompt            (trainer -> PROMPTS)
    rollout    -> RolloutGroup      (rollout -> ROLLOUTS): completions + policy version
    reward     -> ScoredGroup       (reward -> SCORED): one scalar reward per completion, and its parts
    reference  -> ExperienceGroup   (reference -> EXPERIENCE): reference logprobs per token

Tensors travel as ``{"dtype", "shape", "data"}`` with raw little-endian bytes.
Decoding validates everything a consumer relies on, so a bad message is caught
at the door and dead-lettered instead of crashing a stage.

Schema versions: 1, and 2, which adds ``Completion.token_versions`` (the policy version of each token, for rollouts
that take new weights mid-generation). A message is written at the oldest version that holds it: a group without
per-token versions stays 1, which a build that reads only 1 still takes, so producers and consumers can be upgraded
in either order until a rollout starts sending per-token versions. This build reads both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgpack
import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    PlainSerializer,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

SCHEMA_VERSION = 2  # the newest this build writes; it reads every version up to it
READABLE_VERSIONS = (1, 2)
# The dtypes a tensor may travel in: each as sent (little-endian) and as this machine holds it. Built once: a
# message carries a few tensors per completion, and decoding them is most of a message's decoding.
_DTYPES = {
    name: (np.dtype(name).newbyteorder("<"), np.dtype(name)) for name in ("float32", "float64", "int32", "int64")
}
_TENSOR_KEYS = {"dtype", "shape", "data"}


class DecodeError(ValueError):
    """The bytes are not a valid message of the expected kind; the text says why."""


def encode_tensor(array: np.ndarray) -> dict[str, Any]:
    # Little-endian and contiguous: no copy beyond tobytes' own when the array already is (this machine's case).
    wire = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": wire.tobytes()}


def decode_tensor(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if not isinstance(value, dict) or value.keys() != _TENSOR_KEYS:
        raise ValueError("tensor must be a map with dtype, shape and data")
    if value["dtype"] not in _DTYPES:
        raise ValueError(f"tensor dtype {value['dtype']!r} not in {sorted(_DTYPES)}")
    wire, native = _DTYPES[value["dtype"]]
    shape = tuple(int(d) for d in value["shape"])
    if len(value["data"]) != wire.itemsize * math.prod(shape):
        raise ValueError(
            f"tensor data has {len(value['data'])} bytes, shape {shape} of {wire.name} needs more or fewer"
        )
    return np.frombuffer(value["data"], dtype=wire).reshape(shape).astype(native)


Tensor = Annotated[np.ndarray, BeforeValidator(decode_tensor), PlainSerializer(encode_tensor)]


class Message(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    v: Literal[1, 2] = 1  # as written; ``encode`` writes ``schema_version()``
    kind: str

    def schema_version(self) -> int:
        """The oldest schema version that holds this message (see the module docstring)."""
        return 1


class Prompt(Message):
    kind: Literal["prompt"] = "prompt"
    group_id: str = Field(min_length=1)
    prompt_id: str
    prompt: str
    answer: str = ""
    # The row's info column (data.columns.info): what its environment's reset needs, for a multi-turn run.
    info: dict[str, JsonValue] = Field(default_factory=dict)
    config_version: int = 0
    # The trainer incarnation that fed it (see dedupe_id); empty in messages from before incarnations.
    incarnation: str = ""
    # The rollout generates it with this policy version or a newer one (train.synchronous: the version the
    # trainer has just published); 0 for whatever version the rollout holds.
    min_policy_version: int = Field(default=0, ge=0)


class Episode(BaseModel):
    """How a multi-turn episode went (``rollout.environment`` set); absent on single-turn completions."""

    model_config = ConfigDict(extra="forbid")

    turns: int = Field(ge=1)
    tool_calls: int = Field(ge=0)
    tool_errors: int = Field(ge=0)
    env_seconds: float = Field(ge=0)
    # The environment's reward parts summed (StepResult.reward_part): the reward part 'environment'.
    env_reward: float = Field(default=0.0, allow_inf_nan=False)
    outcome: Literal["done", "max_turns", "max_tokens", "env_error", "timeout", "truncated"]


class Completion(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    text: str
    token_ids: Tensor
    logprobs: Tensor
    finish_reason: Literal["stop", "length"]
    # 1 on tokens the model sampled, 0 on tokens an environment inserted (observations, tool output); None: all 1.
    # Logprobs at masked-out positions are 0 and are never used.
    loss_mask: Tensor | None = None
    # The policy version that sampled each token (int32 [T]; schema 2), for a rollout that loaded new weights while
    # generating; None: every token is the group's policy_version. Tokens an environment inserted carry the version
    # in force when they were inserted and are never trained on.
    token_versions: Tensor | None = None
    episode: Episode | None = None

    @model_validator(mode="after")
    def _aligned_and_finite(self) -> Completion:
        if self.token_ids.ndim != 1 or self.logprobs.shape != self.token_ids.shape:
            raise ValueError(f"logprobs shape {self.logprobs.shape} must match token_ids shape {self.token_ids.shape}")
        if not np.isfinite(self.logprobs).all():
            raise ValueError("sampling logprobs contain NaN or inf")
        if self.loss_mask is not None:
            if self.loss_mask.shape != self.token_ids.shape:
                raise ValueError(f"loss_mask shape {self.loss_mask.shape} must match token_ids {self.token_ids.shape}")
            if not np.isin(self.loss_mask, (0, 1)).all() or not self.loss_mask.any():
                raise ValueError("loss_mask must be 0/1 with at least one 1")
        if self.token_versions is not None:
            if self.token_versions.shape != self.token_ids.shape:
                raise ValueError(
                    f"token_versions shape {self.token_versions.shape} must match token_ids {self.token_ids.shape}"
                )
            if self.token_versions.dtype.kind != "i" or (self.token_versions < 0).any():
                raise ValueError("token_versions must be non-negative integers")
        return self

    @model_serializer(mode="wrap")
    def _as_schema_1_without_versions(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Written as schema 1 wrote it when it has no per-token versions: a build that reads only 1 refuses any key
        # it does not know, even one that is null.
        data = handler(self)
        if self.token_versions is None:
            del data["token_versions"]
        return data

    def versions(self, group_version: int) -> np.ndarray:
        """The policy version of each token (int64 [T]): ``token_versions``, or ``group_version`` for every token."""
        if self.token_versions is None:
            return np.full(self.token_ids.shape, group_version, dtype=np.int64)
        return self.token_versions.astype(np.int64)

    def sampled_versions(self, group_version: int) -> np.ndarray:
        """The versions of the tokens the model sampled (``loss_mask`` 1): the ones a loss is taken on."""
        versions = self.versions(group_version)
        return versions if self.loss_mask is None else versions[self.loss_mask == 1]


class RolloutGroup(Prompt):
    kind: Literal["rollout"] = "rollout"
    prompt_ids: Tensor
    # The version the rollout held when the group was done: the newest any of its tokens was sampled with.
    policy_version: int = Field(ge=0)
    completions: list[Completion] = Field(min_length=1)

    @model_validator(mode="after")
    def _versions_up_to_the_group_s(self) -> RolloutGroup:
        versioned = [c.token_versions for c in self.completions if c.token_versions is not None]
        for versions in versioned:
            if versions.size and int(versions.max()) > self.policy_version:
                raise ValueError(
                    f"token_versions reach {int(versions.max())}, past the group's policy_version "
                    f"{self.policy_version} (the newest version that sampled it)"
                )
        return self

    def schema_version(self) -> int:
        return 2 if any(c.token_versions is not None for c in self.completions) else 1

    def oldest_version(self) -> int:
        """The oldest policy version that sampled a token of the group: what its staleness is measured by."""
        # initial: a completion that stopped before its first token has none; no token is newer than the group.
        return min(
            int(c.sampled_versions(self.policy_version).min(initial=self.policy_version)) for c in self.completions
        )

    def versions_used(self) -> set[int]:
        """Every policy version that sampled a token of the group."""
        return {int(v) for c in self.completions for v in np.unique(c.sampled_versions(self.policy_version))}


class ScoredGroup(RolloutGroup):
    kind: Literal["scored"] = "scored"
    rewards: Tensor
    # Each reward source's own score per completion before weighting (rule function name, "model", "http"):
    # ``rewards`` is their weighted sum. Reported per step as ``reward/<name>/mean``.
    reward_parts: dict[str, Tensor] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_finite_reward_each(self) -> ScoredGroup:
        expected = (len(self.completions),)
        for name, values in {"rewards": self.rewards, **self.reward_parts}.items():
            if values.shape != expected:
                raise ValueError(f"{name} shape {values.shape} must be {expected}")
            if not np.isfinite(values).all():
                raise ValueError(f"{name} contain NaN or inf")
        return self


def reward_part_means(groups: Sequence[ScoredGroup]) -> dict[str, float]:
    """``reward/<name>/mean`` over every completion of ``groups`` that carries the part ``name``."""
    parts: dict[str, list[np.ndarray]] = {}
    for group in groups:
        for name, values in group.reward_parts.items():
            parts.setdefault(name, []).append(values)
    return {f"reward/{name}/mean": float(np.concatenate(values).mean()) for name, values in sorted(parts.items())}


class ExperienceGroup(ScoredGroup):
    kind: Literal["experience"] = "experience"
    ref_logprobs: list[Tensor]

    @model_validator(mode="after")
    def _reference_aligned(self) -> ExperienceGroup:
        if len(self.ref_logprobs) != len(self.completions):
            raise ValueError("one ref_logprobs tensor per completion is required")
        for ref, completion in zip(self.ref_logprobs, self.completions, strict=False):
            if ref.shape != completion.token_ids.shape:
                raise ValueError(f"ref_logprobs shape {ref.shape} must match token_ids {completion.token_ids.shape}")
            if not np.isfinite(ref).all():
                raise ValueError("reference logprobs contain NaN or inf")
        return self


def dedupe_id(message: Prompt, stage: str) -> str:
    """The ``Nats-Msg-Id`` of ``message`` as ``stage`` publishes it: one per group, stage and trainer incarnation.

    A resumed trainer continues its incarnation, so a prompt it feeds again inside the duplicate window is dropped
    as a repeat at every hop; a trainer that starts over without a checkpoint is a new incarnation, and the groups
    it feeds under the same ids are new work rather than repeats of what its abandoned steps used."""
    return ".".join(part for part in (message.group_id, message.incarnation, stage) if part)


M = TypeVar("M", bound=Message)


def advance(message: Message, kind: type[M], **added: Any) -> M:
    """The next stage's message: everything ``message`` carries plus the ``added`` fields."""
    fields = {name: getattr(message, name) for name in type(message).model_fields if name != "kind"}
    return kind.model_validate(fields | added)


class ClaimCheck(Message):
    """Stands in for a message too large for the bus: the message itself is in the object store under ``key``."""

    kind: Literal["claim"] = "claim"
    key: str
    size: int
    sha256: str


def packed(value: Any) -> bytes:
    """msgpack's bytes of ``value``, binary kept binary. (msgpack is untyped: its ``Packer.pack`` returns None only
    for a packer that does not reset, which ``packb`` never makes.)"""
    data = msgpack.packb(value, use_bin_type=True)
    if not isinstance(data, bytes):
        raise TypeError(f"msgpack packed {type(value).__name__} into {type(data).__name__}, not bytes")
    return data


def encode(message: Message) -> bytes:
    return packed(message.model_dump() | {"v": message.schema_version()})


def decode(data: bytes, kind: type[M]) -> M:
    """Parse and validate ``data`` as ``kind``; raises DecodeError with the reason."""
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception as error:  # msgpack raises many unrelated types for garbage
        raise DecodeError(f"not msgpack: {error}") from None
    if not isinstance(raw, dict):
        raise DecodeError(f"message must be a map, got {type(raw).__name__}")
    if raw.get("v") not in READABLE_VERSIONS:
        raise DecodeError(f"schema version {raw.get('v')!r} is not supported (this build reads {READABLE_VERSIONS})")
    try:
        return kind.model_validate(raw)
    except ValidationError as error:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc'])) or kind.__name__}: {e['msg']}" for e in error.errors()[:5])
        raise DecodeError(f"invalid {kind.__name__}: {reasons}") from None
