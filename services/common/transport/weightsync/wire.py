"""The wire format of a pull: a snapshot cut into CRC-checked chunks, a chunk's data found without protobuf copying
it, tensors rebuilt from chunks in stream order, and the digest of a whole stream that a pull from a peer is checked
against the trainer's with. No I/O here."""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from services.common.pb import weights_pb2 as pb
from services.common.transport.weightsync.snapshot import Snapshot

CHUNK_BYTES = 1 << 20  # what a client that does not ask gets; well under gRPC's 4 MiB default message limit
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 16 << 20
_DATA_FIELD = pb.WeightChunk.DESCRIPTOR.fields_by_name["data"].number
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name


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


class StreamDigest:
    """SHA-256 over a pull's tensors in stream order: per tensor a length-prefixed header (its names, aliases
    included, wire dtype, shape and byte size), then its data bytes.

    Chunk boundaries do not enter it, so every replica that pulls a version in one dtype (and with aliases, as
    rollouts do) gets the trainer's digest whatever chunk size it or a relay asked for. It is what the trainer
    vouches for: a relay forwards the trainer's chunks unchanged, so a stream from a peer that hashes otherwise
    was altered on the way (the CRCs cannot tell, a peer recomputes them)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def tensor(self, names: Sequence[str], dtype: str, shape: Sequence[int], tensor_bytes: int) -> None:
        header = json.dumps([list(names), dtype, [int(n) for n in shape], int(tensor_bytes)]).encode()
        self._hash.update(len(header).to_bytes(8, "little") + header)

    def data(self, data: bytes | memoryview) -> None:
        self._hash.update(data)

    def digest(self) -> bytes:
        return self._hash.digest()


def digest_key(dtype: torch.dtype | None, aliases: bool) -> tuple[str, bool]:
    """What a digest depends on besides the version: the wire dtype asked for and whether aliases travel once."""
    return dtype_text(dtype), aliases


def chunks_of(
    snapshot: Snapshot, chunk_bytes: int = CHUNK_BYTES, dtype: torch.dtype | None = None, aliases: bool = False
) -> Iterator[pb.WeightChunk]:
    """The snapshot as chunks of at most ``chunk_bytes`` data each, cut at element boundaries.

    The first stream of a (dtype, aliases) also keeps its :class:`StreamDigest` in ``snapshot.digests``, stored
    before the last chunk goes out: a replica that got the version through relays, which asks once its stream
    ended, finds it there."""
    key = (str(dtype), chunk_bytes, aliases)
    known = snapshot.crcs.get(key)
    digest = StreamDigest() if digest_key(dtype, aliases) not in snapshot.digests else None
    crcs: list[int] = []
    pending: pb.WeightChunk | None = None  # held back one chunk, so the digest is stored before the last one goes
    for names, tensor in _groups(snapshot.tensors, aliases):
        sent = wire_dtype(tensor.dtype, dtype)
        numel = tensor.numel()
        itemsize = torch.empty(0, dtype=sent).element_size()
        per_chunk = max(1, chunk_bytes // itemsize)
        sent_text = dtype_text(sent)
        if digest is not None:
            digest.tensor(names, sent_text, tensor.shape, numel * itemsize)
        for start in range(0, max(numel, 1), per_chunk):
            # Sliced out of the snapshot (or its shared cast) chunk by chunk: no per-pull copy of a tensor.
            data = _raw_bytes(snapshot.piece(tensor, sent, start, min(start + per_chunk, numel)))
            crc = known[len(crcs)] if known is not None else zlib.crc32(data)
            crcs.append(crc)
            if digest is not None:
                digest.data(data)
            if pending is not None:
                yield pending
            pending = pb.WeightChunk(
                version=snapshot.version,
                name=names[0],
                dtype=sent_text,
                shape=list(tensor.shape),
                offset=start * itemsize,
                tensor_bytes=numel * itemsize,
                data=data,
                crc32=crc,
                aliases=names[1:] if start == 0 else [],
            )
    # Every chunk was made: their CRCs and the digest are whole, even if the last one never leaves.
    snapshot.crcs[key] = crcs
    if digest is not None:
        snapshot.digests.setdefault(digest_key(dtype, aliases), digest.digest())
    if pending is not None:
        yield pending


def digest_of(snapshot: Snapshot, dtype: torch.dtype | None = None, aliases: bool = False) -> bytes:
    """The :class:`StreamDigest` of ``snapshot`` as :func:`chunks_of` would stream it, for a version no pull has
    streamed in that dtype. Casts a piece at a time into memory of its own (never the snapshot's shared casts), so
    it may run on a worker thread while pulls stream the same snapshot."""
    digest = StreamDigest()
    for names, tensor in _groups(snapshot.tensors, aliases):
        sent = wire_dtype(tensor.dtype, dtype)
        flat = tensor.reshape(-1)
        digest.tensor(names, dtype_text(sent), tensor.shape, flat.numel() * torch.empty(0, dtype=sent).element_size())
        step = max(1, CHUNK_BYTES // flat.element_size())
        for start in range(0, flat.numel(), step):
            digest.data(_raw_bytes(flat[start : start + step].to(sent)))
    return digest.digest()


def dtype_text(dtype: torch.dtype | None) -> str:
    """How PullWeightsRequest.dtype names ``dtype``; "" = as stored."""
    return str(dtype).removeprefix("torch.") if dtype is not None else ""


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


class ChecksumError(RuntimeError):
    pass


class UnverifiedWeights(ChecksumError):
    """A stream from a peer that is not what the trainer serves: another version than the one asked for, or a
    digest the trainer does not confirm. Its tensors must not count as a loaded version."""


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
    can load each one while later chunks are still arriving.

    For a stream from a peer: ``expect_version`` refuses any chunk of another version (before its tensor could be
    loaded), and ``digest`` keeps the stream's :class:`StreamDigest` (``digest()`` once finished) to check
    against the trainer's."""

    def __init__(self, expect_version: int | None = None, digest: bool = False) -> None:
        self.version: int | None = None
        self.data_bytes = 0  # tensor bytes received, as sent (aliases once)
        self.expect_version = expect_version
        self._digest = StreamDigest() if digest else None
        self._partial: _Partial | None = None

    def digest(self) -> bytes | None:
        """The stream's digest so far; None when not asked to keep one."""
        return self._digest.digest() if self._digest is not None else None

    def feed(self, raw: bytes) -> list[tuple[str, torch.Tensor]]:
        header, data = split_chunk(raw)
        if zlib.crc32(data) != header.crc32:
            raise ChecksumError(f"chunk of {header.name} at offset {header.offset} failed its CRC-32")
        if self.expect_version is not None and header.version != self.expect_version:
            raise UnverifiedWeights(f"asked for version {self.expect_version}, sent version {header.version}")
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
                # (numpy's stubs give arrays the buffer protocol on Python 3.12 and later only)
                memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # pyright: ignore[reportArgumentType]
                if header.tensor_bytes
                else memoryview(bytearray())
            )
            partial = self._partial = _Partial(header, tensor, dest)
            if self._digest is not None:
                self._digest.tensor((header.name, *header.aliases), header.dtype, header.shape, header.tensor_bytes)
        if header.offset != partial.filled:
            raise ChecksumError(f"chunk of {header.name} at offset {header.offset} arrived out of order")
        end = partial.filled + len(data)
        if end > partial.header.tensor_bytes:
            raise ChecksumError(f"{header.name}: {end} bytes overflow its {partial.header.tensor_bytes}")
        partial.dest[partial.filled : end] = data  # the one copy, out of the received message into the tensor
        if self._digest is not None:
            self._digest.data(data)
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
