"""The replica counts an operator asked for with ``rlpipe scale ROLE N``, kept in the run's config bucket.

The trainer's Admin ``Scale`` call checks a request (``check_scale``) and stores it as a ``ScaleRecord`` under
``scale.<role>`` in ``RLPIPE_<run>_CONFIG``, beside the config versions and the hold
(services/common/transport/live_config.py): in the broker's store, so it outlives a trainer restart, and written by
the trainer alone, like the rest of that bucket. In a local run the launcher reads the keys with the presence
entries (services/cli/launch/watch.py) and starts or stops replicas until each role has the count asked for
(services/cli/launch/scaling.py). Where an orchestrator owns the count (``supervision.scaler: orchestrator``:
Kubernetes, whose KEDA ScaledObject sizes each stage's Deployment, or compose's ``--scale``) the call is refused
naming where to scale instead: a count nobody acts on would only mislead.

Only the stateless stages scale: their replicas share one durable consumer, so one more is one more puller and one
fewer hands its unacknowledged messages back. The trainer is one process per run, fenced by its lease.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from nats.js.errors import KeyNotFoundError

from services.common.config import RunConfig, SupervisionConfig
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.transport.nats_connect import RUN_OWNER, STAGE_ROLES

log = logging.getLogger(__name__)
KEY_PREFIX = "scale."


class ScaleRefused(ValueError):
    """A scale request that is wrong in itself (a role that does not scale, a count out of bounds)."""


class ScaledElsewhere(ScaleRefused):
    """A scale request this run cannot carry out: an orchestrator, not ``rlpipe run``, owns its replicas."""


@dataclass(frozen=True)
class ScaleRecord:
    """One request: ``replicas`` of ``role``, asked by ``author`` at ``time`` (wall clock)."""

    role: str
    replicas: int
    author: str
    time: float
    revision: int = 0  # the key's revision in the bucket when read: each stored request has a new one

    def encode(self) -> bytes:
        return json.dumps({k: v for k, v in asdict(self).items() if k != "revision"}).encode()

    @classmethod
    def decode(cls, data: bytes, revision: int) -> ScaleRecord:
        raw = json.loads(data)
        record = cls(str(raw["role"]), int(raw["replicas"]), str(raw["author"]), float(raw["time"]), revision)
        if record.role not in STAGE_ROLES or record.replicas < 0:
            raise ValueError(f"not a stage role's replica count: {raw}")
        return record


def scale_key(role: str) -> str:
    return KEY_PREFIX + role


def configured_replicas(cfg: RunConfig, role: str) -> int | None:
    """The replicas of ``role`` the config starts: ``rollout.replicas``, ``reward.replicas``, ``reference.replicas``;
    None for ``rollout.replicas: auto``, whose count the launcher's placement decides at start."""
    replicas = getattr(cfg, role).replicas
    return None if replicas == "auto" else replicas


def check_scale(role: str, replicas: int, supervision: SupervisionConfig, deterministic: bool = False) -> None:
    """Raises ScaleRefused naming what is wrong with asking for ``replicas`` of ``role``; ScaledElsewhere when
    this run's replicas are an orchestrator's to scale. A ``deterministic`` run (train.deterministic) keeps one
    replica of each role: which replica takes a group would otherwise decide what the run computes."""
    if role == RUN_OWNER:
        raise ScaleRefused(
            "the trainer does not scale: a run has one trainer, fenced by its lease, and a second would be refused "
            "it; give it more devices with trainer.nproc (one process per device) at a restart"
        )
    if role not in STAGE_ROLES:
        raise ScaleRefused(f"unknown role {role!r}: one of {', '.join(STAGE_ROLES)}")
    if replicas < 0:
        raise ScaleRefused(f"{replicas} replicas: a count is 0 or more (0 stops every {role} replica)")
    if replicas > supervision.max_replicas:
        raise ScaleRefused(
            f"{replicas} {role} replicas is more than supervision.max_replicas ({supervision.max_replicas}); "
            "raise it in the run's config if this machine can hold that many"
        )
    if deterministic and replicas > 1:
        raise ScaleRefused(
            f"{replicas} {role} replicas in a train.deterministic run: a reproducible run has one replica of each "
            "role; restart it without train.deterministic to scale"
        )
    if supervision.scaler != "launcher":
        raise ScaledElsewhere(
            f"this run's {role} replicas are started by an orchestrator, not `rlpipe run` (supervision.scaler: "
            f"{supervision.scaler}): scale them there. Kubernetes: KEDA's ScaledObject `{role}` sizes the Deployment "
            f"(set its minReplicaCount/maxReplicaCount; without KEDA, `kubectl scale deployment/{role} "
            f"--replicas={replicas}`); compose: `docker compose up -d --scale {role}={replicas}`"
        )


async def store_scale(kv: Any, role: str, replicas: int, author: str) -> ScaleRecord:
    """Store a request (already checked) as the count of ``role``; the record as stored."""
    record = ScaleRecord(role, replicas, author or "unknown", round(time.time(), 3))
    revision = await kv.put(scale_key(role), record.encode())
    return ScaleRecord(record.role, record.replicas, record.author, record.time, revision)


async def read_scale(kv: Any) -> dict[str, ScaleRecord]:
    """The stored request of each stage role that has one; one this build cannot read is logged and left out
    (the role keeps the count it has)."""
    records = {}
    for role in STAGE_ROLES:
        try:
            entry = await kv.get(scale_key(role))
        except KeyNotFoundError:
            continue
        try:
            records[role] = ScaleRecord.decode(entry.value, entry.revision)
        except (ValueError, TypeError, KeyError) as error:
            log_event(log, Event.SCALE_RECORD_MALFORMED, level=logging.WARNING, key=scale_key(role), error=str(error))
    return records


async def forget_scale(kv: Any) -> None:
    """Drop every stored request: a run started again (``rlpipe run --resume``) starts the config's counts."""
    for role in STAGE_ROLES:
        await kv.delete(scale_key(role))
