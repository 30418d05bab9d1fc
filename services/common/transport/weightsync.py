"""Trainer -> rollout weight sync over gRPC (``proto/weights.proto``).

The trainer publishes each new policy version as an immutable snapshot of its
state dict; rollouts watch for versions and pull a snapshot as a stream of
CRC-checked chunks. A tensor is handed on as soon as its last chunk arrived, so a
rollout can load it while the rest of the model is still on the wire.

Where the time goes, and what this module does about it (measured with
``python -m bench.weight_sync``):

- Protobuf decoding of a chunk copies its data twice (parse, then the ``data``
  accessor). The client asks gRPC for the raw message bytes instead, lets protobuf
  parse only the small fields (:func:`split_chunk` cuts the data field out) and
  checks and copies the data straight from the received buffer into the tensor.
- The server slices each chunk out of the snapshot's memory, so a pull never holds a
  second whole copy of a tensor; tensors that share storage (tied embeddings) are
  copied once into the snapshot and sent once to clients that accept aliases.
- A client can ask for the rollout's dtype (bf16 halves the bytes of an fp32 trainer). Each tensor is
  cast once per version, on the first pull that needs it, and the cast kept with the snapshot for every
  later puller (the cast cost more than the wire).

Fan-out (``python -m bench.weight_fanout``): the trainer's egress is what N replicas share, so a version
leaves the trainer at most ``fanout`` times whatever N is. Replicas that keep a ``WatchVersions`` stream
open with their ``relay_address`` form a tree, fixed when a version is published (join order, ``fanout``
children per node, the trainer at the root); each announcement tells a replica where to pull from and
whether to keep what it pulls for its children (:class:`Relay`). A relay forwards the raw messages it
received as they arrive, so a version crosses the tree in about one model transfer plus a chunk per
level, not one transfer per level. Any pull from a peer that fails falls back to the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field

import grpc
import torch

from services.common.pb import weights_pb2 as pb
from services.common.pb import weights_pb2_grpc as pb_grpc

CHUNK_BYTES = 1 << 20  # what a client that does not ask gets; well under gRPC's 4 MiB default message limit
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 16 << 20
# What our client asks for: big enough that per-message costs vanish, small enough to stay in cache while
# the data is checked and copied (bench/weight_sync.py --chunk-kib measures the choice).
PULL_CHUNK_BYTES = 1 << 20
_DATA_FIELD = pb.WeightChunk.DESCRIPTOR.fields_by_name["data"].number
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name
_PULL_METHOD = f"/{SERVICE_NAME}/PullWeights"
DEFAULT_FANOUT = 2  # replicas the trainer, and each relay, serves a version to directly


@dataclass(frozen=True)
class Snapshot:
    version: int
    step: int
    tensors: tuple[tuple[str, torch.Tensor], ...]
    # Chunk CRCs per (wire dtype, chunk bytes, aliases), filled by the first pull of this version and reused by
    # every later one: N replicas cost the trainer one checksum pass per version, not N.
    crcs: dict[tuple[str, int, bool], list[int]] = field(default_factory=dict, compare=False, repr=False)
    # Tensors cast to a wire dtype (flat), by (id of the stored tensor, dtype): filled chunk by chunk by the first
    # pull that asks for that dtype and shared by every later one, freed with the snapshot when the next version
    # replaces it. `cast_upto` is how many elements of each are filled (every pull walks a tensor in order).
    casts: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    cast_upto: dict[tuple[int, torch.dtype], int] = field(default_factory=dict, compare=False, repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def piece(self, tensor: torch.Tensor, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of ``tensor`` (one of this snapshot's, flattened) in ``dtype``, cast once.

        The cast is kept whole but made a chunk at a time, as pulls reach it: casting a whole tensor into
        fresh memory at once measured 2-6x slower than chunk by chunk (page faults, cache misses)."""
        flat = tensor.reshape(-1)
        if tensor.dtype == dtype:
            return flat[start:stop]
        key = (id(tensor), dtype)
        cast = self.casts.get(key)
        if cast is None:
            cast = self.casts[key] = torch.empty(flat.numel(), dtype=dtype)
        done = self.cast_upto.get(key, 0)
        if stop > done:
            cast[done:stop].copy_(flat[done:stop])
            self.cast_upto[key] = stop
        return cast[start:stop]

    def info(self) -> pb.PolicyVersion:
        return pb.PolicyVersion(
            version=self.version, step=self.step, num_tensors=len(self.tensors), total_bytes=self.total_bytes
        )


class NonFiniteWeights(ValueError):
    """Weights holding NaN or infinite values: never served to rollouts, never saved."""


def non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors in ``tensors`` that hold a NaN or an infinite value."""
    return [name for name, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def snapshot_of(model: torch.nn.Module, version: int, step: int) -> Snapshot:
    """A detached CPU copy of ``model``'s parameters and buffers, safe to stream while training goes on.

    Names that share storage (tied embeddings) share one copy: they are listed under every name, because
    vLLM's reload_weights keeps its own lm_head and does not re-tie it, but cost host memory once."""
    copies: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor] = {}
    tensors = []
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() == 0 or key not in copies:
            copies[key] = t.detach().to("cpu", copy=True).contiguous()
        tensors.append((name, copies[key]))
    return Snapshot(version=version, step=step, tensors=tuple(tensors))


def _groups(tensors: Iterable[tuple[str, torch.Tensor]], aliases: bool) -> list[tuple[list[str], torch.Tensor]]:
    """(names, tensor) in state-dict order; with ``aliases``, one entry for every tensor object named twice."""
    groups: list[tuple[list[str], torch.Tensor]] = []
    seen: dict[int, list[str]] = {}
    for name, tensor in tensors:
        if aliases and id(tensor) in seen:
            seen[id(tensor)].append(name)
            continue
        names = [name]
        seen[id(tensor)] = names
        groups.append((names, tensor))
    return groups


def wire_dtype(stored: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """Only floating-point tensors change dtype on the wire; integer buffers (position ids) go as stored."""
    return requested if requested is not None and stored.is_floating_point else stored


def _raw_bytes(piece: torch.Tensor) -> bytes:
    # uint8 view: numpy has no bfloat16, and the wire carries bytes anyway.
    return piece.reshape(-1).view(torch.uint8).numpy().tobytes()


def chunks_of(
    snapshot: Snapshot, chunk_bytes: int = CHUNK_BYTES, dtype: torch.dtype | None = None, aliases: bool = False
) -> Iterator[pb.WeightChunk]:
    """The snapshot as chunks of at most ``chunk_bytes`` data each, cut at element boundaries."""
    key = (str(dtype), chunk_bytes, aliases)
    known = snapshot.crcs.get(key)
    crcs: list[int] = []
    for names, tensor in _groups(snapshot.tensors, aliases):
        sent = wire_dtype(tensor.dtype, dtype)
        numel = tensor.numel()
        itemsize = torch.empty(0, dtype=sent).element_size()
        per_chunk = max(1, chunk_bytes // itemsize)
        for start in range(0, max(numel, 1), per_chunk):
            # Sliced out of the snapshot (or its shared cast) chunk by chunk: no per-pull copy of a tensor.
            data = _raw_bytes(snapshot.piece(tensor, sent, start, min(start + per_chunk, numel)))
            crc = known[len(crcs)] if known is not None else zlib.crc32(data)
            crcs.append(crc)
            yield pb.WeightChunk(
                version=snapshot.version,
                name=names[0],
                dtype=str(sent).removeprefix("torch."),
                shape=list(tensor.shape),
                offset=start * itemsize,
                tensor_bytes=numel * itemsize,
                data=data,
                crc32=crc,
                aliases=names[1:] if start == 0 else [],
            )
    snapshot.crcs[key] = crcs  # only a stream that ran to the end gets here


def dtype_text(dtype: torch.dtype | None) -> str:
    """How PullWeightsRequest.dtype names ``dtype``; "" = as stored."""
    return str(dtype).removeprefix("torch.") if dtype is not None else ""


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def relay_route(plan: tuple[str, ...], address: str, fanout: int) -> tuple[str, bool]:
    """Where the replica at ``address`` pulls a version from ("" = the trainer) and whether it relays it.

    ``plan`` lists the relaying replicas in join order as a complete ``fanout``-ary tree under the trainer:
    the first ``fanout`` are the trainer's children, and replica ``i``'s children are
    ``fanout * (i + 1)`` onwards. A replica outside the plan (joined after the version was published, or a
    client that does not relay) pulls from the trainer."""
    if fanout < 1 or address not in plan:
        return "", False
    at = plan.index(address)
    parent = plan[(at - fanout) // fanout] if at >= fanout else ""
    return parent, fanout * (at + 1) < len(plan)


class WeightSyncServer(pb_grpc.WeightSyncServicer):
    """Holds the newest snapshot and wakes watchers when a new one is published.

    ``fanout`` bounds how many replicas pull each version from here (0: every replica does, as before
    relaying); the rest get it from a peer, see :func:`relay_route`."""

    def __init__(self, initial: Snapshot, fanout: int = DEFAULT_FANOUT):
        self.latest = initial
        self.fanout = fanout
        self.sent_bytes = 0  # tensor data streamed by PullWeights, all versions: what the trainer's egress pays
        self._changed = asyncio.Condition()
        # Open watch streams per relay address, in join order (dicts keep insertion order).
        self._members: dict[str, int] = {}
        # The tree of the latest version, fixed at publish: every replica is told its part of one tree.
        self._plan: tuple[str, ...] = ()

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self._members)

    async def publish(self, snapshot: Snapshot) -> None:
        """Serve ``snapshot`` as the newest version; raises ``NonFiniteWeights`` (and keeps serving the previous
        one) when a tensor holds NaN or inf: a rollout that loaded it would sample garbage for every prompt."""
        broken = await asyncio.to_thread(non_finite, snapshot.tensors)
        if broken:
            raise NonFiniteWeights(
                f"policy version {snapshot.version} (step {snapshot.step}) is not served: {len(broken)} tensor(s) "
                f"hold NaN or inf ({', '.join(broken[:3])}{', ...' if len(broken) > 3 else ''}); "
                f"rollouts keep version {self.latest.version}"
            )
        async with self._changed:
            self.latest = snapshot
            self._plan = tuple(self._members)
            self._changed.notify_all()

    def announcement(self, snapshot: Snapshot, address: str) -> pb.PolicyVersion:
        info = snapshot.info()
        if snapshot is self.latest:
            info.source, info.relay = relay_route(self._plan, address, self.fanout)
        return info

    async def GetVersion(self, request: pb.GetVersionRequest, context: grpc.aio.ServicerContext) -> pb.PolicyVersion:
        return self.latest.info()

    async def WatchVersions(
        self, request: pb.WatchVersionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PolicyVersion]:
        seen = request.after_version
        address = request.relay_address
        if address:
            self._members[address] = self._members.get(address, 0) + 1
        try:
            while True:
                async with self._changed:
                    # Bound now (the default), so the predicate reads this pass's `seen`, not whatever the loop
                    # set later.
                    await self._changed.wait_for(lambda after=seen: self.latest.version > after)
                    current = self.latest
                seen = current.version
                yield self.announcement(current, address)
        finally:  # the stream ended (the replica went away): later versions' trees leave it out
            if address:
                self._members[address] -= 1  # in place: a replica with a second stream keeps its position
                if not self._members[address]:
                    del self._members[address]

    async def PullWeights(
        self, request: pb.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WeightChunk]:
        # Taken once: the whole stream is this version even if the trainer publishes the next one meanwhile.
        snapshot = self.latest
        if request.version and request.version != snapshot.version:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"version {request.version} is gone; newest is {snapshot.version}"
            )
        try:
            dtype = dtype_named(request.dtype) if request.dtype else None
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        chunk_bytes = min(max(request.chunk_bytes or CHUNK_BYTES, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
        for chunk in chunks_of(snapshot, chunk_bytes, dtype, request.accept_aliases):
            self.sent_bytes += len(chunk.data)
            yield chunk


class ChecksumError(RuntimeError):
    pass


def _varint(buffer: bytes | memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buffer[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def split_chunk(raw: bytes) -> tuple[pb.WeightChunk, memoryview]:
    """A serialized WeightChunk as (its small fields parsed by protobuf, its data as a view into ``raw``).

    Protobuf would copy the data twice (into its arena, then out through the accessor); here only the
    data field's bounds are found by walking the wire format, and protobuf parses the rest."""
    at = 0
    while at < len(raw):
        start = at
        key, at = _varint(raw, at)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, at = _varint(raw, at)
        elif wire_type == 2:
            length, at = _varint(raw, at)
            if field == _DATA_FIELD:
                header = pb.WeightChunk.FromString(raw[:start] + raw[at + length :])
                if header.data:
                    raise ChecksumError("a chunk carries its data field twice")
                return header, memoryview(raw)[at : at + length]
            at += length
        elif wire_type in (1, 5):
            at += 8 if wire_type == 1 else 4
        else:
            raise ChecksumError(f"malformed chunk: wire type {wire_type} at byte {start}")
    return pb.WeightChunk.FromString(raw), memoryview(b"")  # an empty tensor: proto3 leaves empty bytes out


@dataclass
class _Partial:
    header: pb.WeightChunk
    tensor: torch.Tensor
    dest: memoryview  # the tensor's bytes
    filled: int = 0


class TensorAssembler:
    """Rebuilds tensors from serialized chunks in stream order, checking each chunk as it comes (no I/O).

    ``feed`` returns the tensors its chunk completed, under every name (aliases included), so the caller
    can load each one while later chunks are still arriving."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.data_bytes = 0  # tensor bytes received, as sent (aliases once)
        self._partial: _Partial | None = None

    def feed(self, raw: bytes) -> list[tuple[str, torch.Tensor]]:
        header, data = split_chunk(raw)
        if zlib.crc32(data) != header.crc32:
            raise ChecksumError(f"chunk of {header.name} at offset {header.offset} failed its CRC-32")
        if self.version is None:
            self.version = header.version
        elif header.version != self.version:
            raise ChecksumError(f"chunks from versions {self.version} and {header.version} mixed")
        partial = self._partial
        if partial is None or partial.header.name != header.name:
            self.finish()
            if header.offset != 0:
                raise ChecksumError(f"chunk of {header.name} at offset {header.offset} arrived out of order")
            tensor = torch.empty(tuple(header.shape), dtype=dtype_named(header.dtype))
            if tensor.numel() * tensor.element_size() != header.tensor_bytes:
                raise ChecksumError(
                    f"{header.name}: shape {list(header.shape)} does not hold {header.tensor_bytes} bytes"
                )
            dest = (
                memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                if header.tensor_bytes
                else memoryview(bytearray())
            )
            partial = self._partial = _Partial(header, tensor, dest)
        if header.offset != partial.filled:
            raise ChecksumError(f"chunk of {header.name} at offset {header.offset} arrived out of order")
        end = partial.filled + len(data)
        if end > partial.header.tensor_bytes:
            raise ChecksumError(f"{header.name}: {end} bytes overflow its {partial.header.tensor_bytes}")
        partial.dest[partial.filled : end] = data  # the one copy, out of the received message into the tensor
        partial.filled = end
        self.data_bytes += len(data)
        if end < partial.header.tensor_bytes:
            return []
        self._partial = None
        return [(name, partial.tensor) for name in (partial.header.name, *partial.header.aliases)]

    def finish(self) -> None:
        """Raises if a tensor was left incomplete (the stream ended or moved on mid-tensor)."""
        partial = self._partial
        if partial is not None:
            raise ChecksumError(f"{partial.header.name}: got {partial.filled} of {partial.header.tensor_bytes} bytes")


def assemble(chunks: Iterable[pb.WeightChunk]) -> tuple[int, dict[str, torch.Tensor]]:
    """Verify every chunk and rebuild the tensors; raises ChecksumError on any mismatch or gap."""
    assembler = TensorAssembler()
    tensors = dict(item for chunk in chunks for item in assembler.feed(chunk.SerializeToString()))
    assembler.finish()
    return assembler.version or 0, tensors


# Reconnect soon after the trainer comes back (gRPC's default backoff grows to minutes).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# Chunks up to MAX_CHUNK_BYTES plus their small fields.
CHANNEL_OPTIONS = [*RECONNECT_OPTIONS, ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + (1 << 16))]


class WeightStream:
    """One pull. Iterate for ``(name, tensor)`` pairs, each as soon as it is complete and checked; ``version``
    is known from the first chunk on. An error (the trainer went away, a bad chunk) raises from the loop.

    The serialized chunks come from a gRPC call or from this process's own :class:`Relay`."""

    def __init__(self, call: AsyncIterable[bytes], cancel: Callable[[], object] | None = None):
        self._call = call
        self._cancel = cancel if cancel is not None else getattr(call, "cancel", lambda: None)
        self._assembler = TensorAssembler()

    @property
    def version(self) -> int | None:
        return self._assembler.version

    @property
    def data_bytes(self) -> int:
        return self._assembler.data_bytes

    async def __aiter__(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        async for raw in self._call:
            for item in self._assembler.feed(raw):
                yield item
        self._assembler.finish()

    def cancel(self) -> None:
        self._cancel()


class WeightSyncClient:
    def __init__(self, address: str, chunk_bytes: int = PULL_CHUNK_BYTES):
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.WeightSyncStub(self.channel)
        self.chunk_bytes = chunk_bytes
        # No deserializer: the raw message bytes come back, for split_chunk to take the data without copies.
        self._pull = self.channel.unary_stream(
            _PULL_METHOD, request_serializer=pb.PullWeightsRequest.SerializeToString, response_deserializer=None
        )

    async def version(self, timeout: float = 5.0) -> pb.PolicyVersion:
        return await self.stub.GetVersion(pb.GetVersionRequest(), timeout=timeout)

    def watch(self, after_version: int, relay_address: str = "") -> AsyncIterator[pb.PolicyVersion]:
        """Announcements of new versions; with ``relay_address``, this replica joins the relay tree while the
        stream is open and each announcement says where to pull from."""
        request = pb.WatchVersionsRequest(after_version=after_version, relay_address=relay_address)
        return self.stub.WatchVersions(request)

    def raw(
        self, version: int = 0, dtype: torch.dtype | None = None, timeout: float = 120.0
    ) -> grpc.aio.UnaryStreamCall:
        """A pull as the serialized chunks, unchecked: what a relay keeps and forwards."""
        request = pb.PullWeightsRequest(
            version=version, chunk_bytes=self.chunk_bytes, dtype=dtype_text(dtype), accept_aliases=True
        )
        return self._pull(request, timeout=timeout)

    def stream(self, version: int = 0, dtype: torch.dtype | None = None, timeout: float = 120.0) -> WeightStream:
        """Pull ``version`` (0: the newest), floating-point tensors as ``dtype`` if given."""
        return WeightStream(self.raw(version, dtype, timeout))

    async def pull(
        self, version: int = 0, dtype: torch.dtype | None = None, timeout: float = 120.0
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """The whole version at once (tools and tests; a rollout streams it into its engine instead)."""
        stream = self.stream(version, dtype, timeout)
        tensors = {name: tensor async for name, tensor in stream}
        return stream.version or 0, tensors

    async def close(self) -> None:
        await self.channel.close()


class RelayBroken(RuntimeError):
    """The pull a relay was forwarding broke off; the puller goes to the trainer instead."""


class RelayBuffer:
    """One version as a relay received it: serialized chunks in stream order, readable while still arriving.

    Kept whole until the next version replaces it, so a child that syncs late still finds it: a relaying
    replica holds one copy of the model in the wire dtype on the host."""

    def __init__(self, version: int, dtype: str):
        self.version = version
        self.dtype = dtype  # PullWeightsRequest.dtype it was pulled with
        self.chunks: list[tuple[bytes, int]] = []  # (serialized chunk, its tensor data bytes)
        self.done = False
        self.error: BaseException | None = None
        self._more = asyncio.Event()

    def _wake(self) -> None:
        # Readers wait on the event they saw; a fresh one for the next wait, so none misses a wake-up.
        self._more.set()
        self._more = asyncio.Event()

    def append(self, raw: bytes) -> None:
        self.chunks.append((raw, len(split_chunk(raw)[1])))
        self._wake()

    def finish(self, error: BaseException | None = None) -> None:
        if not self.done:
            self.done, self.error = True, error
            self._wake()

    @property
    def complete(self) -> bool:
        return self.done and self.error is None

    async def read(self) -> AsyncIterator[tuple[bytes, int]]:
        """Every chunk, waiting for more until the pull that fills it ends; raises RelayBroken if it broke."""
        at = 0
        while True:
            more = self._more
            while at < len(self.chunks):
                yield self.chunks[at]
                at += 1
            if self.done:
                if self.error is not None:
                    raise RelayBroken(f"the relayed pull of version {self.version} broke: {self.error!r}"[:300])
                return
            await more.wait()

    async def fill(self, call: AsyncIterable[bytes]) -> None:
        """Receive a pull into this buffer; its readers follow chunk by chunk. Raises what broke the pull."""
        try:
            async for raw in call:
                self.append(raw)
        except BaseException as error:  # cancelled too: readers must not wait for chunks that never come
            self.finish(error)
            raise
        self.finish()


class Relay(pb_grpc.WeightSyncServicer):
    """A rollout's side of the tree: serves the version it is relaying to the peers the trainer sends to it.

    Chunks go out as the bytes that came in (no protobuf work), and as soon as they came in. Register it with
    :func:`add_relay_to_server`; the generated registration would serialize them again."""

    def __init__(self, wait_s: float = 10.0):
        self.current: RelayBuffer | None = None
        self.wait_s = wait_s  # how long a child that asks first waits for this relay to start the version
        self.sent_bytes = 0
        self._changed = asyncio.Condition()

    async def begin(self, version: int, dtype: str) -> RelayBuffer:
        """Start relaying ``version`` (its pull is the caller's, see RelayBuffer.fill); the previous one is
        dropped once the children still reading it are done."""
        async with self._changed:
            self.current = RelayBuffer(version, dtype)
            self._changed.notify_all()
            return self.current

    def _matching(self, version: int) -> RelayBuffer | None:
        current = self.current
        return current if current is not None and (version in (0, current.version)) else None

    async def GetVersion(self, request: pb.GetVersionRequest, context: grpc.aio.ServicerContext) -> pb.PolicyVersion:
        current = self.current
        return pb.PolicyVersion(version=current.version if current is not None and current.complete else 0)

    async def PullWeights(  # type: ignore[override]  # yields serialized chunks, see add_relay_to_server
        self, request: pb.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        # A child may hear of the version before this relay does: wait a little for it to start.
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait_for(
                        lambda: self.current is not None and self.current.version >= request.version
                    ),
                    self.wait_s,
                )
        buffer = self._matching(request.version)
        if buffer is None or (buffer.done and buffer.error is not None):
            have = self.current.version if self.current is not None else 0
            await context.abort(grpc.StatusCode.NOT_FOUND, f"relay has no version {request.version} (has {have})")
        assert buffer is not None  # abort raised otherwise
        if request.dtype != buffer.dtype or not request.accept_aliases:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"relay holds {buffer.dtype or 'as stored'} with aliases; asked {request.dtype or 'as stored'}",
            )
        try:
            async for raw, data_bytes in buffer.read():
                self.sent_bytes += data_bytes
                yield raw
        except RelayBroken as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))


def add_relay_to_server(relay: Relay, server: grpc.aio.Server) -> str:
    """Serve ``relay`` as WeightSync (PullWeights and GetVersion); returns the service name."""
    handlers = {
        # No response serializer: the chunks are already serialized, exactly as received.
        "PullWeights": grpc.unary_stream_rpc_method_handler(
            relay.PullWeights, request_deserializer=pb.PullWeightsRequest.FromString
        ),
        "GetVersion": grpc.unary_unary_rpc_method_handler(
            relay.GetVersion,
            request_deserializer=pb.GetVersionRequest.FromString,
            response_serializer=pb.PolicyVersion.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    return SERVICE_NAME
