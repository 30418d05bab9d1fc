"""Trainer -> rollout weight sync over gRPC (``proto/weights.proto``).

The trainer publishes each new policy version as an immutable snapshot of its
state dict; rollouts watch for versions and pull a snapshot as a stream of
CRC-checked chunks, reassembled into tensors before anything is loaded.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from services.common.pb import weights_pb2 as pb
from services.common.pb import weights_pb2_grpc as pb_grpc

CHUNK_BYTES = 1 << 20  # well under gRPC's 4 MiB default message limit
_NUMPY_VIEW = {torch.bfloat16: torch.int16}  # numpy has no bfloat16: ship the raw bits


@dataclass(frozen=True)
class Snapshot:
    version: int
    step: int
    tensors: tuple[tuple[str, torch.Tensor], ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def info(self) -> pb.PolicyVersion:
        return pb.PolicyVersion(
            version=self.version, step=self.step, num_tensors=len(self.tensors), total_bytes=self.total_bytes
        )


def snapshot_of(model: torch.nn.Module, version: int, step: int) -> Snapshot:
    """A detached CPU copy of ``model``'s parameters and buffers, safe to stream while training goes on."""
    # Tied tensors go under both names: vLLM's reload_weights keeps its own lm_head copy and does not re-tie it.
    tensors = tuple((name, t.detach().to("cpu", copy=True).contiguous()) for name, t in model.state_dict().items())
    return Snapshot(version=version, step=step, tensors=tensors)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    view = _NUMPY_VIEW.get(tensor.dtype)
    return (tensor.view(view) if view else tensor).numpy().tobytes()


def chunks_of(snapshot: Snapshot) -> Iterator[pb.WeightChunk]:
    for name, tensor in snapshot.tensors:
        data = _tensor_bytes(tensor)
        dtype = str(tensor.dtype).removeprefix("torch.")
        for offset in range(0, max(len(data), 1), CHUNK_BYTES):
            piece = data[offset : offset + CHUNK_BYTES]
            yield pb.WeightChunk(
                version=snapshot.version,
                name=name,
                dtype=dtype,
                shape=list(tensor.shape),
                offset=offset,
                tensor_bytes=len(data),
                data=piece,
                crc32=zlib.crc32(piece),
            )


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
        snapshot = self.latest
        if request.version and request.version != snapshot.version:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"version {request.version} is gone; newest is {snapshot.version}"
            )
        for chunk in chunks_of(snapshot):
            yield chunk


class ChecksumError(RuntimeError):
    pass


def assemble(chunks: list[pb.WeightChunk]) -> tuple[int, dict[str, torch.Tensor]]:
    """Verify every chunk and rebuild the tensors; raises ChecksumError on any mismatch or gap."""
    buffers: dict[str, tuple[pb.WeightChunk, bytearray]] = {}
    version = chunks[0].version if chunks else 0
    for chunk in chunks:
        if zlib.crc32(chunk.data) != chunk.crc32:
            raise ChecksumError(f"chunk of {chunk.name} at offset {chunk.offset} failed its CRC-32")
        if chunk.version != version:
            raise ChecksumError(f"chunks from versions {version} and {chunk.version} mixed")
        first, buffer = buffers.setdefault(chunk.name, (chunk, bytearray()))
        if chunk.offset != len(buffer):
            raise ChecksumError(f"chunk of {chunk.name} at offset {chunk.offset} arrived out of order")
        buffer.extend(chunk.data)
    tensors = {}
    for name, (first, buffer) in buffers.items():
        if len(buffer) != first.tensor_bytes:
            raise ChecksumError(f"{name}: got {len(buffer)} of {first.tensor_bytes} bytes")
        dtype = getattr(torch, first.dtype)
        view = _NUMPY_VIEW.get(dtype)
        array = np.frombuffer(bytes(buffer), dtype=torch.empty(0, dtype=view or dtype).numpy().dtype)
        tensor = torch.from_numpy(array.copy()).reshape(tuple(first.shape))
        tensors[name] = tensor.view(dtype) if view else tensor
    return version, tensors


# Reconnect soon after the trainer comes back (gRPC's default backoff grows to minutes).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class WeightSyncClient:
    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS)
        self.stub = pb_grpc.WeightSyncStub(self.channel)

    async def version(self, timeout: float = 5.0) -> pb.PolicyVersion:
        return await self.stub.GetVersion(pb.GetVersionRequest(), timeout=timeout)

    def watch(self, after_version: int) -> AsyncIterator[pb.PolicyVersion]:
        return self.stub.WatchVersions(pb.WatchVersionsRequest(after_version=after_version))

    async def pull(self, version: int = 0, timeout: float = 120.0) -> tuple[int, dict[str, torch.Tensor]]:
        chunks = [
            chunk async for chunk in self.stub.PullWeights(pb.PullWeightsRequest(version=version), timeout=timeout)
        ]
        return assemble(chunks)

    async def close(self) -> None:
        await self.channel.close()
