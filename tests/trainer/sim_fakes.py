"""What the recovery simulation's trainer talks to, small and in memory (tests/trainer/simulation.py): the clock, the
broker, the object stores, the lease bucket, the learner and the weight server. Each tells the simulation's oracle
(``sim_oracle.Oracle``) what happened in the world: a prompt landed, a dead letter was written, a step trained, a
store write landed.

A crash can land between any two effects: ``Effects.crash_after`` arms a countdown over every store write, broker
publish or purge, lease write and lineage record, and the effect it reaches raises ``SimCrash`` (a BaseException, so
no ``except Exception`` in the components swallows it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from services.common.transport.bus import Bus
from services.common.transport.messages import DecodeError
from services.common.transport.streams import (
    DEAD,
    EXPERIENCE,
    H_GROUP,
    H_INCARNATION,
    H_REINJECTED,
    H_SEQ,
    H_STREAM,
    OPERATOR,
    StreamGap,
    StreamMessage,
    dead_subject,
    stream_name,
)
from services.trainer.checkpointing.lineage import Lineage, LineageRecord
from services.trainer.checkpointing.manifest import FENCE
from services.trainer.checkpointing.state import Checkpoint, CheckpointCorrupt
from services.trainer.learning.learner_state import LearnerState

if TYPE_CHECKING:
    from services.common.config import RunConfig
    from services.trainer.intake.reader import Collected
    from tests.trainer.sim_oracle import Oracle

DUPLICATE_WINDOW_S = 30.0  # the simulated broker's duplicate window, on the simulated clock
WALL_EPOCH = 1.7e9  # the simulated wall clock (the lease's) is the monotonic one moved to a plausible date


class SimCrash(BaseException):
    """The process dies here: raised by the effect a crash was armed for."""


class Clock:
    """The simulated clock: ``intake``, ``adopter`` and the lease read it instead of ``time``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return WALL_EPOCH + self.now


@dataclass
class Effects:
    """Counts the effects that reach the world and crashes the process at the one ``crash_after`` names."""

    crash_after: int | None = None

    def effect(self, what: str) -> None:
        if self.crash_after is None:
            return
        if self.crash_after == 0:
            self.crash_after = None
            raise SimCrash(what)
        self.crash_after -= 1


class SimStore:
    """An ``ObjectStore`` in memory; ``fail_next`` calls raise OSError (a store outage the components retry)."""

    def __init__(self, url: str, effects: Effects) -> None:
        self.url = url
        self.objects: dict[str, bytes] = {}
        self.fail_next = 0
        self.effects = effects
        self.weights_read = 0  # checkpoints loaded from this store (their weights read)

    def _call(self) -> None:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise OSError("simulated store outage")

    def put(self, key: str, data: bytes, tags: Mapping[str, str] | None = None) -> None:
        self._call()  # tags select lifecycle rules, which the simulation has none of
        self.effects.effect(f"store put {key}")
        self.objects[key] = bytes(data)

    def get(self, key: str, limit: int | None = None) -> bytes:
        self._call()
        if key not in self.objects:
            raise FileNotFoundError(key)
        self.weights_read += key.endswith("/model.safetensors")
        data = self.objects[key]
        return data if limit is None else data[:limit]

    def list(self, prefix: str) -> list[str]:
        self._call()
        return sorted(key for key in self.objects if key.startswith(prefix))

    def delete_prefix(self, prefix: str) -> None:
        self._call()
        self.effects.effect(f"store delete {prefix}")
        for key in [key for key in self.objects if key.startswith(prefix)]:
            del self.objects[key]

    def delete(self, keys: list[str]) -> None:
        self._call()
        self.effects.effect(f"store delete {keys[:1]}")
        for key in keys:
            self.objects.pop(key, None)


class StoreView:
    """One trainer process's connection to a store: the writes that land are reported to the oracle with the lease
    epoch of the process that made them, so a write from a fenced-out trainer is seen whatever the store code did."""

    def __init__(self, store: SimStore, oracle: Oracle, writer: Any) -> None:
        self.store = store
        self.oracle = oracle
        self.writer = writer  # has ``epoch``: the lease epoch it holds, None without a lease
        self.url = store.url

    def _landed(self, key: str, data: bytes = b"") -> None:
        if key.endswith(f"/{FENCE}"):
            self.oracle.fence_claimed(int(json.loads(data)["epoch"]))
        self.oracle.store_written(self.store.url, key, self.writer.epoch)

    def put(self, key: str, data: bytes, tags: Mapping[str, str] | None = None) -> None:
        self.store.put(key, data, tags)
        self._landed(key, data)

    def get(self, key: str, limit: int | None = None) -> bytes:
        return self.store.get(key, limit)

    def list(self, prefix: str) -> list[str]:
        return self.store.list(prefix)

    def delete_prefix(self, prefix: str) -> None:
        self.store.delete_prefix(prefix)
        self._landed(prefix)

    def delete(self, keys: list[str]) -> None:
        self.store.delete(keys)
        self._landed(keys[0] if keys else "")


@dataclass
class Stream:
    """One JetStream stream: messages by sequence, first and last sequence, purges."""

    name: str
    messages: dict[int, StreamMessage] = field(default_factory=dict)
    last_seq: int = 0

    def append(self, data: bytes, headers: dict[str, str], subject: str = "") -> int:
        self.last_seq += 1
        self.messages[self.last_seq] = StreamMessage(self.last_seq, data, headers, subject)
        return self.last_seq

    @property
    def first_seq(self) -> int:
        return min(self.messages, default=self.last_seq + 1)

    def purge(self, below: int) -> None:
        for seq in [seq for seq in self.messages if seq < below]:
            del self.messages[seq]

    def lose_tail(self, count: int) -> list[StreamMessage]:
        """A broker back without its last ``count`` writes (unsynced): they are gone and their sequences reused."""
        kept_through = max(self.last_seq - count, self.first_seq - 1)
        lost = [self.messages.pop(seq) for seq in sorted(self.messages) if seq > kept_through]
        self.last_seq = kept_through
        return lost


class SimReader:
    """``StreamReader`` over a ``Stream``, as strict as the real one (services/common/transport/reader.py): the stream
    is checked (the real ``Bus.check_covers``) before the first read after a seek and after every reconnect, and a
    message past the expected sequence on EXPERIENCE raises ``StreamGap``: a reader never steps over lost messages.
    DEAD may have holes (letters age out). Nothing is read ahead: the intake looks at DEAD before every read, its
    most searching order."""

    buffered = 0

    def __init__(self, bus: SimBus, edge: str, start_seq: int) -> None:
        self.bus = bus
        self.edge = edge
        self.stream = bus.streams[edge]
        self.seek(start_seq)

    def seek(self, start_seq: int) -> None:
        self.next_seq = start_seq
        self.empty = False  # the last read found nothing: the simulated loop takes that as an interrupt
        self.verified_reconnects: int | None = None

    async def next(self, timeout: float) -> StreamMessage | None:
        if self.verified_reconnects != self.bus.reconnects:
            await Bus.check_covers(self.bus, self.edge, self.next_seq - 1, contiguous=self.edge != DEAD)  # type: ignore[arg-type]
            self.verified_reconnects = self.bus.reconnects
        seqs = [seq for seq in self.stream.messages if seq >= self.next_seq]
        if not seqs:
            self.empty = True
            if self.bus.reads_wait:
                self.bus.clock.now += timeout  # nothing came within the timeout
            return None
        seq = min(seqs)
        if seq != self.next_seq and self.edge != DEAD:
            raise StreamGap(stream_name(self.bus.run_id, self.edge), self.next_seq, seq)
        self.next_seq = seq + 1
        return self.stream.messages[seq]


@dataclass
class SimGroup:
    """What ``Bus.decode`` gives the intake for an EXPERIENCE message: the fields it reads."""

    group_id: str
    policy_version: int
    incarnation: str
    rewards: np.ndarray
    prompt_ids: np.ndarray = field(default_factory=lambda: np.array([1, 2]))
    completions: list[Any] = field(default_factory=list)

    # Without per-token versions every token is the group's (RolloutGroup.oldest_version, versions_used).
    def oldest_version(self) -> int:
        return self.policy_version

    def versions_used(self) -> set[int]:
        return {self.policy_version}


@dataclass
class Fed:
    """A prompt on PROMPTS that the simulated rollouts have not taken yet."""

    group_id: str
    incarnation: str


class SimBus:
    """The broker as the intake and recovery use it. Survives trainer crashes: it is another process."""

    def __init__(self, clock: Clock, effects: Effects, oracle: Oracle) -> None:
        self.run_id = "sim"
        self.clock = clock
        self.effects = effects
        self.oracle = oracle
        self.streams = {edge: Stream(edge) for edge in (EXPERIENCE, DEAD)}
        self.created = datetime(2026, 1, 1, tzinfo=UTC)
        self.dedupe: dict[str, float] = {}  # msg id -> when it leaves the duplicate window
        self.prompts: list[Fed] = []  # PROMPTS, a work queue the rollouts take from in any order
        self.taken: list[Fed] = []  # prompts a rollout took, which it may compute again later
        self.js = self
        self.claims = self
        self.fail_next = 0  # broker calls that fail (a NATS outage), for the intake's breaker and retries
        self.publishes = 0  # prompt publishes tried: during an outage every other one fails, see ``publish``
        self.reconnects = 0  # a reader checks its stream again after each (as the real one does)
        self.reads_wait = False  # an empty read waits out its timeout on the clock
        self.experience_reader: SimReader | None = None  # the live trainer's: where it reads EXPERIENCE next

    def _stream(self, name: str) -> Stream:
        return next(s for edge, s in self.streams.items() if name.endswith(edge.upper()))

    def _duplicate(self, msg_id: str) -> bool:
        if self.dedupe.get(msg_id, 0.0) > self.clock.now:
            return True
        self.dedupe[msg_id] = self.clock.now + DUPLICATE_WINDOW_S
        return False

    async def publish(self, edge: str, message: Any, msg_id: str) -> SimpleNamespace:
        # A feed publishes its prompts together; failing every other one lands them out of order, the case where
        # a later prompt may settle before the one the broker refused is fed again (GroupLedger.unfed_from).
        self.publishes += 1
        if self.fail_next > 0 and self.publishes % 2:
            self.fail_next -= 1
            raise TimeoutError("simulated broker outage")
        self.effects.effect(f"publish {message.group_id}")
        self.oracle.prompt_landed(message.incarnation, message.group_id)
        duplicate = self._duplicate(msg_id)
        if not duplicate:
            self.prompts.append(Fed(message.group_id, message.incarnation))
        return SimpleNamespace(duplicate=duplicate)

    def experience(self, fed: Fed, policy_version: int, poisoned: bool = False, alike: bool = False) -> bool:
        """A rollout's group reaches EXPERIENCE (unless the duplicate window takes it for a repeat); ``alike``: its
        rewards are all equal, which dynamic sampling filters out."""
        if self._duplicate(f"{fed.group_id}.{fed.incarnation}.experience"):
            return False
        body = b"poison" if poisoned else f"{fed.group_id}|{policy_version}|{fed.incarnation}|{int(alike)}".encode()
        self.streams[EXPERIENCE].append(body, {H_GROUP: fed.group_id, H_INCARNATION: fed.incarnation})
        return True

    async def decode(self, msg: StreamMessage, kind: type) -> SimGroup:
        if msg.data == b"poison":
            raise DecodeError("invalid ExperienceGroup: simulated malformed body")
        group_id, version, incarnation, alike = msg.data.decode().split("|")
        rewards = np.array([1.0, 1.0]) if alike == "1" else np.array([0.0, 1.0])
        return SimGroup(group_id, int(version), incarnation, rewards)

    def reinject(self, sequence: int, policy_version: int) -> bool:
        """``rlpipe dead-letters --reinject SEQ`` with a fixed body: the record in DEAD first, then the group back on
        EXPERIENCE. The same letter again inside the duplicate window is a no-op; returns whether it was published."""
        letter = self.streams[DEAD].messages.get(sequence)
        headers = (letter.headers or {}) if letter is not None else {}
        group_id, incarnation = headers.get(H_GROUP), headers.get(H_INCARNATION, "")
        if not group_id or H_REINJECTED in headers or self._duplicate(f"reinjected.{sequence}"):
            return False
        origin = {H_STREAM: headers.get(H_STREAM, ""), H_SEQ: headers.get(H_SEQ, "")}
        record = {H_GROUP: group_id, H_INCARNATION: incarnation, H_REINJECTED: str(sequence), **origin}
        self.streams[DEAD].append(b"", record, dead_subject(self.run_id, OPERATOR))
        self.oracle.reinjected(incarnation, group_id, f"{origin[H_STREAM]}:{origin[H_SEQ]}")
        body = f"{group_id}|{policy_version}|{incarnation}|0".encode()
        self.streams[EXPERIENCE].append(body, {H_GROUP: group_id, H_INCARNATION: incarnation})
        return True

    def claim_key(self, msg: StreamMessage) -> None:
        return None

    async def dead_letter(self, msg: StreamMessage, reason: str, edge: str) -> None:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise TimeoutError("simulated broker outage")
        self.effects.effect(f"dead letter {msg.sequence}")
        origin = stream_name(self.run_id, edge)
        headers = {**(msg.headers or {}), H_STREAM: origin, H_SEQ: str(msg.sequence)}
        self.streams[DEAD].append(msg.data, headers, dead_subject(self.run_id, "trainer"))  # the trainer's own subject
        self.oracle.dead_lettered(headers.get(H_INCARNATION, ""), headers.get(H_GROUP, ""), f"{origin}:{msg.sequence}")

    async def groups_queued(self, incarnation: str) -> set[str]:
        """PROMPTS's prompts no rollout took yet: they wait for one however long (work_queues.groups_queued)."""
        return {fed.group_id for fed in self.prompts if fed.incarnation in ("", incarnation)}

    def read_from(self, edge: str, start_seq: int) -> SimReader:
        reader = SimReader(self, edge, start_seq)
        if edge == EXPERIENCE:
            self.experience_reader = reader
        return reader

    async def _stream_info(self, name: str) -> SimpleNamespace:
        """What ``Bus.check_covers`` reads (called on this bus: the real check, on the simulated stream)."""
        stream = self._stream(name)
        state = SimpleNamespace(first_seq=stream.first_seq, last_seq=stream.last_seq, messages=len(stream.messages))
        return SimpleNamespace(state=state, created=self.created)

    async def stream_info(self, name: str) -> SimpleNamespace:
        return await self._stream_info(name)

    async def get_msg(self, name: str, seq: int) -> StreamMessage:
        message = self._stream(name).messages.get(seq)
        if message is None:
            raise NotFoundError()
        return message

    async def stream_created(self, edge: str) -> datetime:
        return self.created

    async def purge_stream(self, name: str, seq: int) -> None:
        self.effects.effect(f"purge {name} below {seq}")
        self._stream(name).purge(seq)

    def delete(self, keys: list[str]) -> None:
        pass  # no claim-checked bodies in the simulation

    def restart_losing(self, count: int) -> list[StreamMessage]:
        """The broker restarts without its last ``count`` EXPERIENCE writes (unsynced); readers reconnect."""
        self.reconnects += 1
        return self.streams[EXPERIENCE].lose_tail(count)


class SimKV:
    """The lease bucket: one revision counter, compare-and-set writes (``services/trainer/lease.py``)."""

    def __init__(self, effects: Effects) -> None:
        self.effects = effects
        self.entries: dict[str, SimpleNamespace] = {}
        self.revision = 0

    async def get(self, key: str) -> SimpleNamespace:
        if key not in self.entries:
            raise KeyNotFoundError()
        return self.entries[key]

    def _write(self, key: str, value: bytes) -> int:
        self.effects.effect(f"lease write {key}")
        self.revision += 1
        self.entries[key] = SimpleNamespace(value=value, revision=self.revision)
        return self.revision

    async def create(self, key: str, value: bytes) -> int:
        if key in self.entries:
            raise KeyWrongLastSequenceError()
        return self._write(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        if key not in self.entries or self.entries[key].revision != last:
            raise KeyWrongLastSequenceError()
        return self._write(key, value)


def fold(fingerprint: int, groups: Sequence[tuple[str, int]], dropped: Sequence[str], filtered: Sequence[str]) -> int:
    """The simulated weights after a step, from the weights before it and what it settled, in order: applied
    (with the policy version that generated each), dropped as stale and filtered out. The same fold over the lineage's
    steps gives the same number only if the lineage names exactly the steps that made the weights."""
    applied = ",".join(f"{group}@{version}" for group, version in groups)
    text = f"{fingerprint}|{applied}|{','.join(dropped)}|{','.join(filtered)}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


class SimLearner:
    """The model, as a fingerprint of the steps that made it (``fold``): each step folds what it settled into the
    weights, which a checkpoint stores and a resume or rollback loads. The oracle learns every step it trains and
    every weights it loads, so it knows which history the model holds without asking the trainer's bookkeeping.
    A copy of its state also carries the world's moment it was taken (``Oracle.moment``): a resumed process's memory
    is its checkpoint's, and the oracle needs to know from when."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle
        self.fingerprint = 0  # the base model
        self.copied_at = 0  # the moment the state it loaded was copied; 0: never loaded
        self.base_model = ("", "")  # full weights: no base model under adapters
        self.scheduler = SimpleNamespace(state_dict=lambda: {"last_epoch": 0})

    def train(self, collected: Collected, incarnation: str) -> None:
        """One step on ``collected``'s batch (the step also settles its dropped and filtered groups)."""
        before = self.fingerprint
        groups = [(g.group_id, g.policy_version) for g in collected.batch]
        self.fingerprint = fold(before, groups, collected.dropped, collected.filtered)
        self.oracle.trained(before, self.fingerprint, collected, incarnation)

    def check(self, ckpt: Checkpoint) -> None:
        if set(ckpt.model) != {"w"} or ckpt.model["w"].shape != (2,):
            raise CheckpointCorrupt(f"step {ckpt.step}: the model holds {sorted(ckpt.model)}, not w")

    def load(self, ckpt: Checkpoint) -> None:
        self.fingerprint, self.copied_at = (int(x) for x in ckpt.model["w"])
        self.oracle.loaded(self.fingerprint)

    def reconfigure(self, cfg: RunConfig) -> None:
        pass

    def state(self, optimizer: bool = True) -> LearnerState:
        weights = torch.tensor([self.fingerprint, self.oracle.moment()], dtype=torch.int64)
        return LearnerState(model={"w": weights}, optimizer={} if optimizer else None, critic=None)

    def rng_state(self) -> dict[str, Any]:
        # The shape a checkpoint stores (numpy's entry as in ``np.random.get_state()``), a few bytes long.
        return {"numpy": ("MT19937", np.zeros(1, dtype=np.uint32), 0, 0, 0.0)}

    def snapshot(self, version: int, step: int) -> tuple[int, int]:
        return (version, step)


class SimWeights:
    """The weight server: every version it served, across every trainer process of the scenario."""

    def __init__(self) -> None:
        self.served: list[int] = []

    async def publish(self, snapshot: tuple[int, int]) -> None:
        self.served.append(snapshot[0])


class CountingLineage(Lineage):
    """The real lineage file; each record is an effect a crash can land before. Its records are read again only when
    the file changed (the invariants read them after every op)."""

    def __init__(self, path: Path, effects: Effects) -> None:
        super().__init__(path)
        self.effects = effects
        self._read: tuple[tuple[int, int], list[LineageRecord]] | None = None

    def _append(self, record: LineageRecord) -> None:
        self.effects.effect(f"lineage {type(record).__name__}")
        super()._append(record)

    def records(self) -> list[LineageRecord]:
        if not self.path.exists():
            return []
        stat = self.path.stat()
        key = (stat.st_size, stat.st_mtime_ns)
        if self._read is None or self._read[0] != key:
            self._read = (key, super().records())
        return list(self._read[1])
