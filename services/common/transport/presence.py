"""Service presence: each replica's entry in the key-value bucket ``RLPIPE_<run>_SERVICES``.

A replica writes what it is (role, instance, endpoints, build), which versions it runs
(config, policy) and a heartbeat every few seconds, under the key ``<role>.<instance>``
(``presence_key``). The entry outlives the process, so a restarted replica of the same
name finds its own earlier entry and counts the restart whatever restarted it (the
launcher, Docker, or Kubernetes). The trainer reads the bucket to answer ``rlpipe status``
and to notice a role with no live replica, a role whose loops make no progress (``progress_time``, the
stage's ``last_progress``: a replica stopped with SIGSTOP stops beating and is down; one
whose loop is stuck beats on but its progress time stands still), a replica held by a
dependency that refuses it (``refused``, written at once when it changes), and restart loops
(``RestartCounter``: restarts per role within a window). The trainer creates the bucket;
a replica of another role started before it waits for the bucket (``await_run_state``).

An entry is a ``ServiceEntry`` in JSON; read back it is a ``SeenService`` (the entry, whether it is up and its
restarts). Fields a newer build's replica adds are ignored on read, so replicas of two builds can share a bucket
during a rolling upgrade; an entry that is not a valid ``ServiceEntry`` is logged (``presence_malformed``, naming
the key) and left out, so its role counts as down rather than hiding the others.

The role is the key's first subject token, so the broker can hold each role to its own entries
(``$KV.<bucket>.<role>.>``, services/common/transport/nats_auth.py), and an entry whose ``role`` or ``instance`` is
not what its key names is left out the same way: a stage cannot pass itself off as the trainer (whose entry names
the weight-sync port rollouts dial, ``await_trainer_port``). The bucket's stream refuses ``Nats-Rollup`` headers
(``bucket_stream``), so no writer can wipe the others' entries with one message; a bucket an older build created
(which allowed them) is brought to that at the trainer's start (``upgrade_bucket``), which deletes its entries
under bare instance names (the key scheme before): their replicas write anew under their new keys.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from services.common.cancel import cancel_until_done
from services.common.config import BuildInfo, NatsConfig, RunConfig, ServiceConfig
from services.common.observe import metrics as m
from services.common.observe.events import Event
from services.common.observe.gpu_memory import KINDS, ProcessGpuMemory, process_gpu_memory
from services.common.observe.instruments import record_service_starts
from services.common.observe.logs import log_event
from services.common.transport.breaker import Refusal
from services.common.transport.live_config import LiveConfig
from services.common.transport.nats_connect import SERVICE_ROLES, STAGE_ROLES, await_run_state, creates_run_state

log = logging.getLogger(__name__)
HEARTBEAT_S = 5.0
UP_WITHIN_S = 3 * HEARTBEAT_S
STOPPED_BEAT_TIMEOUT_S = 2.0  # the last beat of an orderly stop: never long enough to hold up a SIGTERM's grace


class ServiceEntry(BaseModel):
    """What a replica writes under its instance name, rewritten every ``HEARTBEAT_S`` seconds."""

    # Ignored, not refused: a replica of a newer build may report more than this build reads.
    model_config = ConfigDict(extra="ignore", frozen=True)

    role: str
    instance: str
    time: float  # wall time of the beat that wrote it, seconds since the epoch
    pid: int = 0
    host: str = ""
    build_version: str = ""
    build_revision: str = ""
    starts: int = 1  # processes of this instance name so far: 1 + its restarts
    grpc: str = ""  # host:port of its gRPC server (the trainer's weight sync, a stage's health)
    admin: str = ""  # the trainer's Admin service, host:port
    metrics_url: str = ""
    config_version: int = 0  # the live config version it runs
    policy_version: int = 0  # trainer and rollout: the policy version it holds
    step: int = 0  # trainer: the last applied step
    progress_time: float | None = None  # stages: wall time its loop last moved; None until it reports
    time_s: dict[str, float] = {}  # stages: seconds its loop spent per activity (busy, idle, blocked)
    refused: Refusal | None = None  # stages: a dependency that refuses it holds its work (outage.OutageGate.refusal)
    # GiB it holds on GPUs (observe/gpu_memory.py): allocated_gb and reserved_gb (torch), used_gb (NVML); each
    # absent where its source is, so empty on a CPU
    gpu_memory: dict[str, float] = {}
    # What its ``ready`` event reported (its load times, what it serves: backend, model, reward functions); empty
    # while it starts. The launcher takes a replica as ready when its entry carries this (services/cli/launch/watch.py).
    startup: dict[str, JsonValue] = {}
    # Written by its last beat when its process ends in order (SIGTERM: a scale-in by KEDA, compose or `rlpipe scale`,
    # a rolling update, a stop): it left, it did not fail, so it is listed as stopped rather than down.
    stopped: bool = False


class SeenService(ServiceEntry):
    """An entry as the trainer read it at one moment."""

    last_seen_s: float  # since its last beat
    up: bool  # beat within UP_WITHIN_S, and not stopped
    restarts: int


def bucket_name(run_id: str) -> str:
    return f"RLPIPE_{run_id}_SERVICES"


def instance_name(service: ServiceConfig, role: str) -> str:
    """``service.instance`` (else ``<role>-<host>``) as a key's tail: characters a key may not hold become ``-``,
    and so does an empty dot-separated token (``a..b``, ``.a``), which no subject may have."""
    name = re.sub(r"[^A-Za-z0-9_=.-]", "-", service.instance or f"{role}-{socket.gethostname()}")
    return ".".join(token or "-" for token in name.split("."))


def presence_key(role: str, instance: str) -> str:
    """The key of a replica's entry: its role first, the token the broker's permissions match on."""
    return f"{role}.{instance}"


def key_role(key: str) -> str:
    """The role a key names: its first token (an instance's own dots come after it)."""
    return key.partition(".")[0]


def bucket_stream(run_id: str, nats: NatsConfig) -> api.StreamConfig:
    """The stream of the presence bucket, as nats-py's ``create_key_value`` makes a bucket's (one message per key,
    direct gets, no deletes through the stream API) but refusing ``Nats-Rollup`` headers, with which any writer
    could remove every entry at once. ``kv.delete`` writes a delete marker, no rollup, so it works as before."""
    name = bucket_name(run_id)
    return api.StreamConfig(
        name=f"KV_{name}",
        subjects=[f"$KV.{name}.>"],
        allow_direct=True,
        allow_rollup_hdrs=False,
        deny_delete=True,
        discard=api.DiscardPolicy.NEW,
        duplicate_window=120.0,
        max_consumers=-1,
        max_msgs=-1,
        max_msgs_per_subject=1,
        num_replicas=nats.stream_replicas,
        storage=api.StorageType.FILE if nats.storage == "file" else api.StorageType.MEMORY,
    )


async def open_bucket(js: Any, run_id: str, nats: NatsConfig, create: bool = True) -> Any:
    """The run's presence bucket: created when missing (its stream refusing rollups, ``bucket_stream``), or
    (``create=False``, a role that may not) waited for."""
    name = bucket_name(run_id)
    if not create:
        return await await_run_state(f"bucket {name}", lambda: js.key_value(name), BucketNotFoundError)
    try:
        return await js.key_value(name)
    except BucketNotFoundError:
        await js.add_stream(bucket_stream(run_id, nats))
        return await js.key_value(name)


async def upgrade_bucket(js: Any, run_id: str) -> None:
    """What the trainer does to a bucket an older build made (a run resumed across the upgrade): deletes its
    entries under bare instance names, then makes its stream refuse rollups. A broker that refuses the change (an
    ``auth.conf`` written by that older build) is logged and the run goes on, with rollups possible as before."""
    name = bucket_name(run_id)
    found = await js.stream_info(f"KV_{name}")
    if not found.config.allow_rollup_hdrs:
        return
    kv = await js.key_value(name)
    for key in await _keys(js, run_id):
        if key_role(key) not in SERVICE_ROLES or "." not in key:
            await kv.delete(key)
    try:
        await js.update_stream(dataclasses.replace(found.config, allow_rollup_hdrs=False))
    except (NatsError, TimeoutError) as error:
        log_event(log, Event.PRESENCE_FAILED, level=logging.WARNING, key=f"KV_{name}", error=repr(error)[:200])
        return
    log_event(log, Event.PRESENCE_UPGRADED, bucket=name)


async def _keys(js: Any, run_id: str) -> list[str]:
    """The bucket's keys, from the stream's subject index: kv.keys() goes through a watcher that can report no keys
    while there are some (nats.py#842), which would make every service look gone."""
    prefix = f"$KV.{bucket_name(run_id)}."
    info = await js.stream_info(f"KV_{bucket_name(run_id)}", subjects_filter=f"{prefix}>")
    return [subject.removeprefix(prefix) for subject in info.state.subjects or {}]


class Presence:
    def __init__(
        self,
        js: Any,
        cfg: RunConfig,
        role: str,
        live: LiveConfig | None = None,
        gpu_memory: Callable[[], ProcessGpuMemory] | None = None,
    ):
        self.js = js
        self.cfg = cfg
        self.role = role
        self.live = live
        self.instance = instance_name(cfg.service, role)
        self.key = presence_key(role, self.instance)
        build = BuildInfo().resolved()
        self.entry = ServiceEntry(
            role=role,
            instance=self.instance,
            time=time.time(),
            pid=os.getpid(),
            host=socket.gethostname(),
            build_version=build.version,
            build_revision=build.revision,
        )
        self.kv: Any = None
        self._task: asyncio.Task | None = None
        # Read at each beat, off the event loop: NVML lists every process on every GPU.
        self.gpu_memory = gpu_memory or (lambda: process_gpu_memory(os.getpid()))

    async def start(self, **info: Any) -> Presence:
        creates = creates_run_state(self.role)
        self.kv = await open_bucket(self.js, self.cfg.run_id, self.cfg.nats, create=creates)
        if creates:
            await upgrade_bucket(self.js, self.cfg.run_id)
        try:
            earlier = json.loads((await self.kv.get(self.key)).value)
            # An earlier entry this build cannot read counts as one start: the restart count starts over.
            self.update(starts=int(earlier.get("starts", 0)) + 1 if isinstance(earlier, dict) else 2)
        except KeyNotFoundError:
            pass
        except (ValueError, TypeError) as error:
            log_event(log, Event.PRESENCE_MALFORMED, level=logging.WARNING, key=self.key, error=str(error)[:300])
            self.update(starts=2)
        self.update(**info)
        record_service_starts(self.role, self.entry.starts)
        await self._beat()
        self._task = asyncio.create_task(self._beat_forever())
        return self

    def update(self, **info: Any) -> None:
        """Change what the next heartbeat reports (endpoints, versions); a name ``ServiceEntry`` lacks is refused."""
        unknown = sorted(info.keys() - ServiceEntry.model_fields.keys())
        if unknown:
            raise ValueError(f"presence entries have no field(s) {unknown}; known: {sorted(ServiceEntry.model_fields)}")
        self.entry = ServiceEntry.model_validate({**self.entry.model_dump(), **info})

    async def announce(self, **info: Any) -> None:
        """``update`` and write the entry now, not at the next heartbeat (which writes it if this cannot)."""
        self.update(**info)
        try:
            await self._beat()
        except Exception as error:  # broker away: the next beat carries it
            log_event(log, Event.PRESENCE_FAILED, level=logging.WARNING, error=repr(error)[:200])

    async def _beat(self) -> None:
        versions = {"config_version": self.live.version} if self.live else {}
        try:
            gpu = (await asyncio.to_thread(self.gpu_memory)).gib()
        except Exception as error:  # a reading NVML or torch refuses costs this beat its figures, never the beat
            log_event(log, Event.GPU_MEMORY_UNREADABLE, level=logging.DEBUG, error=repr(error)[:200])
            gpu = {}
        fields = {**self.entry.model_dump(), **versions, "gpu_memory": gpu, "time": time.time()}
        self.entry = ServiceEntry.model_validate(fields)
        await self.kv.put(self.key, self.entry.model_dump_json().encode())

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._beat()
            except Exception as error:  # broker away: the next beat tries again
                log_event(log, Event.PRESENCE_FAILED, level=logging.DEBUG, error=repr(error)[:200])

    async def stop(self, orderly: bool = False) -> None:
        """Stop beating. ``orderly``: the process ends in order (its loop returned after SIGTERM, not an exception),
        said with a last beat (``stopped``), so it is listed as stopped, not down; a broker out of reach costs that
        beat only, and the entry then goes stale and reads as down, as a failed replica's does."""
        if self._task is not None:
            await cancel_until_done(self._task)
        if self.kv is None or not orderly:
            return
        self.update(stopped=True)
        try:
            await asyncio.wait_for(self._beat(), STOPPED_BEAT_TIMEOUT_S)
        except Exception as error:
            log_event(log, Event.PRESENCE_FAILED, level=logging.WARNING, error=repr(error)[:200])


async def read_presence(js: Any, run_id: str, nats: NatsConfig) -> list[SeenService]:
    """Every replica ever registered in this run, with ``up`` and ``restarts`` worked out; an entry whose role or
    instance is not the one its key names is left out (``presence_malformed``)."""
    kv = await open_bucket(js, run_id, nats)
    now = time.time()
    entries = []
    for key in await _keys(js, run_id):
        try:
            entry = ServiceEntry.model_validate_json((await kv.get(key)).value)
        except KeyNotFoundError:
            continue
        except ValidationError as error:
            log_event(log, Event.PRESENCE_MALFORMED, level=logging.WARNING, key=key, error=str(error)[:300])
            continue
        if presence_key(entry.role, entry.instance) != key:
            error = f"its entry names role {entry.role!r} and instance {entry.instance!r}, not what its key names"
            log_event(log, Event.PRESENCE_MALFORMED, level=logging.WARNING, key=key, error=error[:300])
            continue
        last_seen_s = now - entry.time
        entries.append(
            SeenService(
                **entry.model_dump(),
                last_seen_s=last_seen_s,
                up=last_seen_s <= UP_WITHIN_S and not entry.stopped,
                restarts=entry.starts - 1,
            )
        )
    return sorted(entries, key=lambda e: (e.role, e.instance))


def gone_for(entries: list[SeenService], retention_s: float, spare: str) -> list[SeenService]:
    """The entries whose replica stopped or went silent more than ``retention_s`` seconds ago (none when it is 0),
    that under the key ``spare`` (the reader's own) never."""
    if retention_s <= 0:
        return []
    return [
        e for e in entries if not e.up and e.last_seen_s > retention_s and presence_key(e.role, e.instance) != spare
    ]


async def prune_presence(js: Any, run_id: str, nats: NatsConfig, gone: list[SeenService]) -> list[SeenService]:
    """Delete the entries ``gone`` (any role's: only the trainer, the run's owner, may); those deleted, in order, up
    to the first the broker refused (logged; the rest are tried at the next call). A replica that comes back writes
    its entry anew at its next beat (its restart count then starts over)."""
    kv = await open_bucket(js, run_id, nats, create=False)
    pruned = []
    for entry in gone:
        key = presence_key(entry.role, entry.instance)
        try:
            await kv.delete(key)
        except (NatsError, TimeoutError) as error:
            log_event(log, Event.PRESENCE_FAILED, level=logging.WARNING, key=key, error=repr(error)[:200])
            break
        pruned.append(entry)
    return pruned


async def await_trainer_port(js: Any, run_id: str, nats: NatsConfig, since: float) -> int:
    """The weight-sync port the live trainer's presence entry names, waited for: ``rlpipe run`` starts the
    rollouts with the trainer, before it has bound the port the OS gives it (``service.trainer_grpc_port: 0``).
    Only an entry written at or after ``since`` (wall time) counts, so the entry of a trainer that died before
    this start is never taken; a live trainer rewrites its entry every ``HEARTBEAT_S``. Only an entry under a
    ``trainer.`` key counts (``read_presence``), which only the trainer's NATS key may write."""
    await open_bucket(js, run_id, nats, create=False)  # waits for the trainer to create the bucket
    while True:
        for entry in await read_presence(js, run_id, nats):
            if entry.role == "trainer" and entry.grpc and entry.time >= since:
                return int(entry.grpc.rpartition(":")[2])
        await asyncio.sleep(0.5)


def roles_down(entries: list[SeenService], count_unseen: bool = True) -> list[str]:
    """Pipeline roles with no live replica; ``count_unseen=False`` leaves out roles no replica of
    which has registered yet (still starting: images to pull, engines to load)."""
    up = {entry.role for entry in entries if entry.up}
    seen = {entry.role for entry in entries}
    return [role for role in STAGE_ROLES if role not in up and (count_unseen or role in seen)]


def roles_stalled(entries: list[SeenService], now: float, bound_s: float) -> list[str]:
    """Pipeline roles with live replicas none of which has made progress within ``bound_s`` seconds.

    Only stages report ``progress_time``; a role whose live replicas do not (still starting) is not judged.
    """
    stalled = []
    for role in STAGE_ROLES:
        times = [e.progress_time for e in entries if e.role == role and e.up and e.progress_time is not None]
        if times and now - max(times) > bound_s:
            stalled.append(role)
    return stalled


def roles_refused(entries: list[SeenService]) -> list[str]:
    """Pipeline roles with a live replica held by a dependency that refuses it (a rejected token, TLS, DNS)."""
    return sorted({entry.role for entry in entries if entry.up and entry.refused is not None})


def role_time_shares(entries: list[SeenService]) -> dict[str, dict[str, float]]:
    """role -> activity (busy, idle, blocked) -> its fraction of the role's time, summed over the role's replicas
    (each entry's ``time_s``, the seconds its loop spent in each since it started); roles without any left out."""
    spent: dict[str, dict[str, float]] = {}
    for entry in entries:
        for activity, seconds in entry.time_s.items():
            role = spent.setdefault(entry.role, {})
            role[activity] = role.get(activity, 0.0) + seconds
    return {
        role: {activity: seconds / total for activity, seconds in by_activity.items()}
        for role, by_activity in spent.items()
        if (total := sum(by_activity.values())) > 0
    }


def role_gpu_memory(entries: list[SeenService]) -> dict[str, float]:
    """Step-row keys ``memory/<role>/<figure>_gb`` (``m.ROLE_GPU_MEMORY``): each figure of each entry's
    ``gpu_memory`` summed over the role's live replicas; a figure no live replica reports is left out."""
    row: dict[str, float] = {}
    for entry in entries:
        for figure, gib in entry.gpu_memory.items() if entry.up else ():
            kind = figure.removesuffix("_gb")
            if kind in KINDS:
                key = m.ROLE_GPU_MEMORY.of(entry.role, kind).key
                row[key] = round(row.get(key, 0.0) + gib, 4)
    return row


class RestartCounter:
    """Restarts of each role within the last ``window_s`` seconds, from the ``starts`` of its presence entries.

    Each instance's count is taken against the value it had ``window_s`` ago, or against the first value this
    counter saw when it has watched for less than that: restarts before a trainer came up are not known here.
    """

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, int]]] = {}  # instance -> (time, starts) at each change

    def observe(self, entries: list[SeenService], now: float) -> dict[str, int]:
        per_role: dict[str, int] = {}
        for entry in entries:
            samples = self._samples.setdefault(entry.instance, deque())
            starts = entry.starts
            if not samples or samples[-1][1] != starts:
                samples.append((now, starts))
            # Keep one sample from before the window: the baseline the count is taken against.
            while len(samples) > 1 and samples[1][0] <= now - self.window_s:
                samples.popleft()
            per_role[entry.role] = per_role.get(entry.role, 0) + starts - samples[0][1]
        return per_role
