"""A relaying rollout: keeps the version it pulled, as the serialized chunks it received, and serves them on to
the peers the trainer sends to it while they are still arriving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator

import grpc

from services.common.pb import weights_pb2 as pb
from services.common.pb import weights_pb2_grpc as pb_grpc
from services.common.transport.weightsync.wire import SERVICE_NAME, split_chunk


class RelayBroken(RuntimeError):
    """The pull a relay was forwarding broke off; the puller goes to the trainer instead."""


class RelayBuffer:
    """One version as a relay received it: serialized chunks in stream order, readable while still arriving.

    Kept whole until the next version replaces it, so a child that syncs late still finds it: a relaying
    replica holds one copy of the model in the wire dtype on the host."""

    def __init__(self, version: int, dtype: str):
        self.version = version
        self.dtype = dtype  # PullWeightsRequest.dtype it was pulled with
        self.origin = ""  # the peer its chunks come from; "" = the trainer
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

    def discard(self, error: BaseException) -> None:
        """Drop what was received (the trainer does not vouch for it): no child is served it from now on."""
        self.chunks.clear()
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
