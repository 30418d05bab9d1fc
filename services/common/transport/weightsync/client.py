"""A rollout's side of weight sync: watch for versions and pull one as a stream of checked tensors, from the trainer
or from a relaying peer."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable

import grpc
import torch

from services.common.pb import weights_pb2 as pb
from services.common.pb import weights_pb2_grpc as pb_grpc
from services.common.transport.weightsync.auth import token_metadata
from services.common.transport.weightsync.wire import MAX_CHUNK_BYTES, SERVICE_NAME, TensorAssembler, dtype_text

# What our client asks for: big enough that per-message costs vanish, small enough to stay in cache while
# the data is checked and copied (bench/weight_sync.py --chunk-kib measures the choice).
PULL_CHUNK_BYTES = 1 << 20
_PULL_METHOD = f"/{SERVICE_NAME}/PullWeights"
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

    The serialized chunks come from a gRPC call or from this process's own :class:`Relay`. A stream whose chunks
    came from a peer gives ``expect_version`` (any other version is refused before its first tensor) and keeps its
    ``digest``, for the trainer to confirm."""

    def __init__(
        self,
        call: AsyncIterable[bytes],
        cancel: Callable[[], object] | None = None,
        expect_version: int | None = None,
        digest: bool = False,
    ):
        self._call = call
        self._cancel = cancel if cancel is not None else getattr(call, "cancel", lambda: None)
        self._assembler = TensorAssembler(expect_version, digest)

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

    def digest(self) -> bytes | None:
        """The digest of what was received (complete once iteration ended); None unless asked for."""
        return self._assembler.digest()

    def cancel(self) -> None:
        self._cancel()


class WeightSyncClient:
    """Calls carry ``token`` (the run's RLPIPE_WEIGHTSYNC_TOKEN); ``credentials`` make the channel TLS, ``options``
    add channel options (the certificate name to check, weight_sync_tls.name_override)."""

    def __init__(
        self,
        address: str,
        chunk_bytes: int = PULL_CHUNK_BYTES,
        token: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        options: tuple[tuple[str, str], ...] = (),
    ):
        if credentials is not None:
            self.channel = grpc.aio.secure_channel(address, credentials, options=[*CHANNEL_OPTIONS, *options])
        else:
            self.channel = grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, *options])
        self.token = token
        self.credentials = credentials
        self.options = options
        self._metadata = token_metadata(token)
        self.stub = pb_grpc.WeightSyncStub(self.channel)
        self.chunk_bytes = chunk_bytes
        # No deserializer: the raw message bytes come back, for split_chunk to take the data without copies.
        self._pull = self.channel.unary_stream(
            _PULL_METHOD, request_serializer=pb.PullWeightsRequest.SerializeToString, response_deserializer=None
        )

    async def version(self, timeout: float = 5.0) -> pb.PolicyVersion:
        return await self.stub.GetVersion(pb.GetVersionRequest(), timeout=timeout, metadata=self._metadata)

    def watch(self, after_version: int, relay_address: str = "") -> AsyncIterator[pb.PolicyVersion]:
        """Announcements of new versions; with ``relay_address``, this replica joins the relay tree while the
        stream is open and each announcement says where to pull from."""
        request = pb.WatchVersionsRequest(after_version=after_version, relay_address=relay_address)
        return self.stub.WatchVersions(request, metadata=self._metadata)

    def raw(
        self, version: int = 0, dtype: torch.dtype | None = None, timeout: float = 120.0
    ) -> grpc.aio.UnaryStreamCall:
        """A pull as the serialized chunks, unchecked: what a relay keeps and forwards."""
        request = pb.PullWeightsRequest(
            version=version, chunk_bytes=self.chunk_bytes, dtype=dtype_text(dtype), accept_aliases=True
        )
        return self._pull(request, timeout=timeout, metadata=self._metadata)

    def stream(
        self, version: int = 0, dtype: torch.dtype | None = None, timeout: float = 120.0, peer: bool = False
    ) -> WeightStream:
        """Pull ``version`` (0: the newest), floating-point tensors as ``dtype`` if given. From a ``peer``, the
        stream must be that version and keeps its digest (see WeightStream)."""
        call = self.raw(version, dtype, timeout)
        return WeightStream(call, expect_version=version, digest=True) if peer else WeightStream(call)

    async def digest(self, version: int, dtype: torch.dtype | None = None, timeout: float = 30.0) -> bytes:
        """What the trainer vouches ``version`` streams as in ``dtype`` (with aliases, as every pull here asks):
        a unary call, no weights sent."""
        request = pb.DigestRequest(version=version, dtype=dtype_text(dtype), accept_aliases=True)
        reply = await self.stub.GetDigest(request, timeout=timeout, metadata=self._metadata)
        return reply.sha256

    async def pull(
        self, version: int = 0, dtype: torch.dtype | None = None, timeout: float = 120.0
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """The whole version at once (tools and tests; a rollout streams it into its engine instead)."""
        stream = self.stream(version, dtype, timeout)
        tensors = {name: tensor async for name, tensor in stream}
        return stream.version or 0, tensors

    async def close(self) -> None:
        await self.channel.close()
