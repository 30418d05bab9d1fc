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
- A client can ask for the rollout's dtype (bf16 halves the bytes of an fp32 trainer).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Iterable, Iterator
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
_PULL_METHOD = "/{}/{}".format(
    *pb.DESCRIPTOR.services_by_name["WeightSync"].methods_by_name["PullWeights"].full_name.rsplit(".", 1)
)


@dataclass(frozen=True)
class Snapshot:
    version: int
    step: int
    tensors: tuple[tuple[str, torch.Tensor], ...]
    # Chunk CRCs per (wire dtype, chunk bytes, aliases), filled by the first pull of this version and reused by
    # every later one: N replicas cost the trainer one checksum pass per version, not N.
    crcs: dict[tuple[str, int, bool], list[int]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def info(self) -> pb.PolicyVersion:
        return pb.PolicyVersion(
            version=self.version, step=self.step, num_tensors=len(self.tensors), total_bytes=self.total_bytes
        )


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
        flat = tensor.reshape(-1)
        itemsize = torch.empty(0, dtype=sent).element_size()
        per_chunk = max(1, chunk_bytes // itemsize)
        for start in range(0, max(flat.numel(), 1), per_chunk):
            # Slice and (if asked) cast one chunk at a time: a pull never holds a second copy of a tensor.
            data = _raw_bytes(flat[start : start + per_chunk].to(sent))
            crc = known[len(crcs)] if known is not None else zlib.crc32(data)
            crcs.append(crc)
            yield pb.WeightChunk(
                version=snapshot.version,
                name=names[0],
                dtype=str(sent).removeprefix("torch."),
                shape=list(tensor.shape),
                offset=start * itemsize,
                tensor_bytes=flat.numel() * itemsize,
                data=data,
                crc32=crc,
                aliases=names[1:] if start == 0 else [],
            )
    snapshot.crcs[key] = crcs  # only a stream that ran to the end gets here


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


class WeightSyncServer(pb_grpc.WeightSyncServicer):
    """Holds the newest snapshot and wakes watchers when a new one is published."""

    def __init__(self, initial: Snapshot):
        self.latest = initial
        self._changed = asyncio.Condition()

    async def publish(self, snapshot: Snapshot) -> None:
        async with self._changed:
            self.latest = snapshot
            self._changed.notify_all()

    async def GetVersion(self, request: pb.GetVersionRequest, context: grpc.aio.ServicerContext) -> pb.PolicyVersion:
        return self.latest.info()

    async def WatchVersions(
        self, request: pb.WatchVersionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PolicyVersion]:
        seen = request.after_version
        while True:
            async with self._changed:
                # Bound now (the default), so the predicate reads this pass's `seen`, not whatever the loop set later.
                await self._changed.wait_for(lambda after=seen: self.latest.version > after)
                current = self.latest
            seen = current.version
            yield current.info()

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
    is known from the first chunk on. An error (the trainer went away, a bad chunk) raises from the loop."""

    def __init__(self, call: grpc.aio.UnaryStreamCall):
        self._call = call
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
        self._call.cancel()


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

    def watch(self, after_version: int) -> AsyncIterator[pb.PolicyVersion]:
        return self.stub.WatchVersions(pb.WatchVersionsRequest(after_version=after_version))

    def stream(self, version: int = 0, dtype: torch.dtype | None = None, timeout: float = 120.0) -> WeightStream:
        """Pull ``version`` (0: the newest), floating-point tensors as ``dtype`` if given."""
        request = pb.PullWeightsRequest(
            version=version,
            chunk_bytes=self.chunk_bytes,
            dtype=str(dtype).removeprefix("torch.") if dtype is not None else "",
            accept_aliases=True,
        )
        return WeightStream(self._pull(request, timeout=timeout))

    async def pull(
        self, version: int = 0, dtype: torch.dtype | None = None, timeout: float = 120.0
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """The whole version at once (tools and tests; a rollout streams it into its engine instead)."""
        stream = self.stream(version, dtype, timeout)
        tensors = {name: tensor async for name, tensor in stream}
        return stream.version or 0, tensors

    async def close(self) -> None:
        await self.channel.close()
