"""A follower rank's side of the distributed trainer: what the leader sends with each command, and ``follow``, the
loop that runs the leader's commands until STOP (``distributed.py`` describes the roles).

A command's payload carries what the leader's method was called with, so a follower calls the same ``Learner``
method with the same arguments: a step's groups in their wire format on EXPERIENCE (msgpack), a config change as
the pickled config model, an evaluation's rows. Weights, state and load carry nothing: each rank does its part of
the collective.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import msgpack
import torch

from services.common.config import RunConfig
from services.common.transport.messages import ExperienceGroup, decode, encode, packed
from services.trainer.learning.distributed import Mesh, Op


class Replica(Protocol):
    """What a follower runs for each command: the Learner's methods, called with what the leader sent."""

    def step(self, groups: list[ExperienceGroup], policy_version: int) -> dict[str, float]: ...
    def reconfigure(self, cfg: RunConfig) -> None: ...
    def weights(self) -> dict[str, torch.Tensor]: ...
    def state(self) -> Any: ...
    def load(self, ckpt: Any) -> None: ...
    def evaluate(self, rows: list[dict[str, Any]], max_new_tokens: int) -> float: ...
    def evaluate_episodes(self, rows: list[dict[str, Any]]) -> Any: ...


def step_payload(groups: list[ExperienceGroup], policy_version: int) -> bytes:
    return packed({"groups": [encode(g) for g in groups], "policy_version": policy_version})


def config_payload(cfg: RunConfig) -> bytes:
    # pickle keeps Paths and tuples as they are; msgpack would need a schema for every field type.
    return pickle.dumps(cfg.model_dump(mode="python"))


def evaluate_payload(rows: list[dict[str, Any]], max_new_tokens: int, episodes: bool = False) -> bytes:
    """``episodes``: a multi-turn run's evaluation, whose budgets are the config's, not ``max_new_tokens``."""
    return packed({"rows": rows, "max_new_tokens": max_new_tokens, "episodes": episodes})


def follow(mesh: Mesh, replica: Replica) -> None:
    """A follower's life: run the leader's commands until it says STOP. An exception ends the process (and so,
    through torchrun, the job): a rank that missed its part of a collective cannot go on."""
    while True:
        op, payload = mesh.receive()
        if op is Op.STOP:
            return
        if op is Op.STEP:
            raw = msgpack.unpackb(payload, raw=False)
            replica.step([decode(g, ExperienceGroup) for g in raw["groups"]], raw["policy_version"])
        elif op is Op.RECONFIGURE:
            replica.reconfigure(RunConfig.model_validate(pickle.loads(payload)))
        elif op is Op.WEIGHTS:
            replica.weights()
        elif op is Op.STATE:
            replica.state()
        elif op is Op.LOAD:
            replica.load(None)
        elif op is Op.EVALUATE:
            raw = msgpack.unpackb(payload, raw=False)
            if raw["episodes"]:
                replica.evaluate_episodes(raw["rows"])
            else:
                replica.evaluate(raw["rows"], raw["max_new_tokens"])
        else:  # pragma: no cover - an Op added without a case here
            raise ValueError(f"no follower action for {op!r}")
