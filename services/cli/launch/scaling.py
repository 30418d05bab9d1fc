"""Elastic stage replicas in a local run: ``rlpipe scale ROLE N`` while ``rlpipe run`` goes on.

The request travels the way every operator command does, through the trainer's Admin API, which checks it and
stores the count in the run's config bucket (services/common/transport/scale.py); the launcher reads it with the
presence entries (services/cli/launch/watch.py) and ``ReplicaScaler`` keeps each role at its count:

- Replicas are named ``<role>-0`` to ``<role>-<N-1>``, as ``rlpipe run`` starts them. Scaling up starts the names
  missing, the way the launcher starts any role (warm-forked where it can); scaling down stops the highest-numbered,
  so the names stay 0..N-1 and a later scale-up starts a fresh replica under a freed name (``plan_scale``, pure).
- A replica scaled away gets SIGTERM, and its stage drains: it finishes the batch in hand (publishes every output,
  then acks the inputs) or, stopped in a dependency outage, naks what it holds. One that outlives
  ``supervision.stop_grace_s`` is SIGKILLed: its unacknowledged messages come back to the other replicas after
  ``nats.ack_wait_s``, and a repeated publish is dropped by the duplicate window or, past it, by the trainer,
  which applies no group twice. Nothing is lost or applied twice either way.
- A replica scaled away is never restarted, whatever it exits with; once it has exited it leaves ``run.json`` and
  its presence entry is deleted, so ``rlpipe status`` lists the replicas there are, not one "down". Its name's
  restart history is forgotten with it: a replica started later under that name starts afresh.
- Each change of a role's count is one ``scaled`` row in ``events.jsonl``: the role, the count before (the
  replicas it had) and after, who asked and when.

A run started again with ``--resume`` starts the config's counts (``forget_scale_requests``), as it clears a hold.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import nats
from rich.console import Console

from services.cli.launch.children import Child
from services.common.config import RunConfig
from services.common.observe.events import Event, EventLog
from services.common.transport import live_config, presence
from services.common.transport.nats_auth import RoleKey
from services.common.transport.nats_connect import STAGE_ROLES, connect_options
from services.common.transport.scale import ScaleRecord, forget_scale

# What `rlpipe run` tells its services: it starts and stops the stage replicas, so `rlpipe scale` may change them.
LAUNCHER_SCALES = {"RLPIPE_SUPERVISION__SCALER": "launcher"}
FORGET_TIMEOUT_S = 5.0  # one try at deleting a departed replica's presence entry
FORGET_RETRY_S = 10.0  # a failed try is made again after this: the broker may be restarting


@dataclass(frozen=True)
class ScalePlan:
    """What bringing one role to its count takes now: the names to start, and those to stop (highest first)."""

    start: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()


def replica_index(role: str, name: str) -> int | None:
    """``3`` for ``rollout-3`` of role ``rollout``; None for a name that is not ``<role>-<number>``."""
    match = re.fullmatch(rf"{re.escape(role)}-(\d+)", name)
    return int(match[1]) if match else None


def plan_scale(role: str, members: Collection[str], retiring: Collection[str], target: int) -> ScalePlan:
    """Bring ``role`` to ``target`` replicas named ``<role>-0`` .. ``<role>-<target-1>``.

    ``members``: the role's replicas the launcher keeps (running, or waiting for a restart); ``retiring``: those
    stopped already and not yet exited. Starts each name below ``target`` that is neither (a name still retiring
    is started once its process has gone, at a later look); stops each member numbered ``target`` or higher, and
    any member whose name is not ``<role>-<number>``, highest first."""
    start = tuple(
        name for index in range(target) if (name := f"{role}-{index}") not in members and name not in retiring
    )

    def number(name: str) -> int:  # a name outside the scheme sorts above every replica
        index = replica_index(role, name)
        return sys.maxsize if index is None else index

    stop = sorted((name for name in members if number(name) >= target), key=number, reverse=True)
    return ScalePlan(start, tuple(stop))


@dataclass
class Retiring:
    child: Child
    kill_at: float  # monotonic: past this it is SIGKILLed


@dataclass
class ScaleStep:
    """What one look asks of the launcher: replicas to start, and retired ones that exited (to drop)."""

    start: list[tuple[str, str]] = field(default_factory=list)  # (role, name)
    gone: list[Child] = field(default_factory=list)


class ReplicaScaler:
    """Keeps each stage role at the count operators asked for. The launcher drives it: ``follow`` at every turn of
    its loop, with the requests read and its children; it starts what ``follow`` asks and drops what has gone."""

    def __init__(self, started: dict[str, int], events: EventLog, console: Console):
        """``started``: how many replicas of each stage role the run starts (the config's counts, the placement's
        for ``rollout.replicas: auto``)."""
        self.events = events
        self.console = console
        self.desired: dict[str, int] = dict(started)
        self.taken: dict[str, int] = {}  # role -> revision of the newest request carried out
        self.retiring: dict[str, Retiring] = {}  # name -> the replica scaled away, until it has exited
        self.departed: dict[str, str] = {}  # name -> role: exited replicas whose presence entry is still to delete
        self.forget_tried = -FORGET_RETRY_S  # monotonic time of the last failed deletion

    def wanted(self, name: str) -> bool:
        """Whether the replica ``name`` is still one of its role's: not scaled away. The restart policy asks."""
        return name not in self.retiring

    def follow(self, requests: dict[str, ScaleRecord], children: list[Child], grace_s: float) -> ScaleStep:
        """Take new requests, stop the replicas above each count (SIGTERM; SIGKILL past ``grace_s``), and say what
        to start and which retired replicas have exited."""
        kept = [child for child in children if child.name not in self.retiring]
        members = {role: [child for child in kept if child.role == role] for role in STAGE_ROLES}
        for role, record in requests.items():
            if self.taken.get(role) != record.revision:
                self.taken[role] = record.revision
                self._take(record, len(members[role]))
        step = ScaleStep()
        for role in STAGE_ROLES:
            plan = plan_scale(role, [c.name for c in members[role]], self.retiring.keys(), self.desired[role])
            step.start += [(role, name) for name in plan.start]
            for name in plan.stop:
                child = next(c for c in members[role] if c.name == name)
                self._retire(child, grace_s)
        step.gone = self._reap()
        return step

    def _take(self, record: ScaleRecord, before: int) -> None:
        if record.replicas == self.desired[record.role]:
            return
        self.desired[record.role] = record.replicas
        asked = time.strftime("%H:%M:%S", time.localtime(record.time))
        message = f"{record.role}: {before} -> {record.replicas} replicas, asked by {record.author} at {asked}"
        self.console.log(f"[cyan]scaling[/] {message}")
        self.events.write(
            Event.SCALED,
            message,
            role=record.role,
            before=before,
            after=record.replicas,
            author=record.author,
            asked_at=record.time,
        )

    def _retire(self, child: Child, grace_s: float) -> None:
        """SIGTERM: the stage drains (finishes or hands back its batch) and exits; SIGKILL after ``grace_s``."""
        self.retiring[child.name] = Retiring(child, time.monotonic() + grace_s)
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
        self.console.log(f"stopping {child.name} (scaled away); it drains within {grace_s:g}s")

    def _reap(self) -> list[Child]:
        gone = []
        for name, retiring in list(self.retiring.items()):
            process = retiring.child.process
            if process.poll() is None and time.monotonic() >= retiring.kill_at:
                self.console.log(f"[red]{name} did not drain within its stop grace[/]; killing it")
                process.kill()
            if process.poll() is None:
                continue
            del self.retiring[name]
            self.departed[name] = retiring.child.role
            if retiring.child.pump_thread is not None:
                retiring.child.pump_thread.join(timeout=5)  # its last lines reach its log
            drained = "drained" if process.returncode in (0, -signal.SIGTERM) else f"exited {process.returncode}"
            self.console.log(f"{name} {drained} and is gone")
            gone.append(retiring.child)
        return gone

    def forget_departed(self, forget: Callable[[str, str], bool]) -> None:
        """Delete the presence entries of the replicas that left (``forget(role, name)``); after a failure, the
        next try waits ``FORGET_RETRY_S``, so a broker away does not hold up the launcher's loop at every turn."""
        if time.monotonic() - self.forget_tried < FORGET_RETRY_S:
            return
        for name, role in list(self.departed.items()):
            if not forget(role, name):
                self.forget_tried = time.monotonic()
                return
            del self.departed[name]


def forget_presence(cfg: RunConfig, nats_url: str, key: RoleKey, instance: str) -> bool:
    """Delete ``instance``'s presence entry, with the NATS key of its own role (which may write its role's entries,
    as the replica itself did); False when the broker could not be reached or refused."""

    async def delete() -> None:
        nc = await nats.connect(
            nats_url,
            **connect_options(cfg.nats.model_copy(update={"nkey_seed_file": key.seed_file}), key.role),
            connect_timeout=FORGET_TIMEOUT_S,
            max_reconnect_attempts=0,
        )
        try:
            kv = await nc.jetstream().key_value(presence.bucket_name(cfg.run_id))
            await kv.delete(presence.presence_key(key.role, instance))
        finally:
            await nc.close()

    try:
        asyncio.run(asyncio.wait_for(delete(), FORGET_TIMEOUT_S))
    except Exception:  # the broker away or restarting: the entry stays until the next try
        return False
    return True


def forget_scale_requests(cfg: RunConfig, nats_url: str, trainer_key: RoleKey) -> None:
    """Drop the counts asked for in an earlier start of this run, as the trainer would (only it writes the bucket)."""

    async def forget() -> None:
        as_trainer = cfg.nats.model_copy(update={"nkey_seed_file": trainer_key.seed_file})
        nc = await nats.connect(nats_url, **connect_options(as_trainer, "trainer"))
        try:
            live = await live_config.LiveConfig(cfg, nc.jetstream()).start()
            await forget_scale(live.kv)
        finally:
            await nc.close()

    asyncio.run(forget())
