"""What the trainer vouches for: a version's stream digest, and a relay address tied to its watcher's host."""

import asyncio
import ipaddress
import zlib

import grpc
import pytest
import torch

from services.common.pb import weights_pb2 as pb
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.server import WeightSyncServer, own_relay_address, peer_ip
from services.common.transport.weightsync.snapshot import Snapshot
from services.common.transport.weightsync.wire import (
    MIN_CHUNK_BYTES,
    TensorAssembler,
    UnverifiedWeights,
    chunks_of,
    digest_key,
    digest_of,
)
from tests.support.weights import serve_weights

pytestmark = pytest.mark.integration


def snapshot(version: int) -> Snapshot:
    torch.manual_seed(version)
    shared = torch.randn(40, 3000)  # tied: one tensor under two names, several chunks
    return Snapshot(
        version,
        version,
        (
            ("embed", shared),
            ("w", torch.randn(70_000)),
            ("empty", torch.empty(0)),
            ("head", shared),
            ("ids", torch.arange(9)),
        ),
    )


def streamed_digest(chunks: list[pb.WeightChunk], expect_version: int | None = None) -> bytes | None:
    assembler = TensorAssembler(expect_version=expect_version, digest=True)
    for chunk in chunks:
        assembler.feed(chunk.SerializeToString())
    assembler.finish()
    return assembler.digest()


def forge(chunk: pb.WeightChunk, **changes: object) -> pb.WeightChunk:
    """``chunk`` changed, with a CRC that fits the change: what a relay that forges weights sends."""
    forged = pb.WeightChunk()
    forged.CopyFrom(chunk)
    for field, value in changes.items():
        setattr(forged, field, value)
    forged.crc32 = zlib.crc32(forged.data)
    return forged


@pytest.mark.unit
def test_a_streams_digest_is_the_trainers_whatever_the_chunk_size_and_changes_with_any_byte():
    snap = snapshot(3)
    expected = digest_of(snap, torch.bfloat16, aliases=True)  # computed apart from any pull
    small = list(chunks_of(snap, MIN_CHUNK_BYTES, torch.bfloat16, aliases=True))
    large = list(chunks_of(Snapshot(3, 3, snap.tensors), 4 * MIN_CHUNK_BYTES, torch.bfloat16, aliases=True))
    assert len(small) > len(large)
    assert streamed_digest(small) == streamed_digest(large) == expected
    assert snap.digests == {digest_key(torch.bfloat16, True): expected}  # kept by the first whole stream
    assert digest_of(snap, None, aliases=True) != expected  # another dtype is another stream
    assert digest_of(snap, torch.bfloat16, aliases=False) != expected

    flipped = list(small)
    data = bytearray(flipped[1].data)
    data[5] ^= 1
    flipped[1] = forge(flipped[1], data=bytes(data))
    assert streamed_digest(flipped) != expected  # its CRC passes: only the digest tells
    renamed = [*small[:-1], forge(small[-1], name="other")]  # ids, the last tensor, is one chunk
    assert streamed_digest(renamed) != expected


@pytest.mark.unit
def test_a_stream_from_a_peer_of_another_version_is_refused_at_its_first_chunk():
    chunks = [forge(chunk, version=1 << 62) for chunk in chunks_of(snapshot(2))]
    assembler = TensorAssembler(expect_version=2, digest=True)
    with pytest.raises(UnverifiedWeights, match=f"asked for version 2, sent version {1 << 62}"):
        assembler.feed(chunks[0].SerializeToString())
    assert assembler.version is None  # nothing of it was taken


@pytest.mark.unit
def test_peer_ip_reads_grpcs_peer_strings_and_a_relay_address_must_be_on_that_host():
    assert peer_ip("ipv4:10.0.0.5:41000") == ipaddress.ip_address("10.0.0.5")
    assert peer_ip("ipv6:[::1]:41000") == ipaddress.ip_address("::1")
    assert peer_ip("ipv6:[::ffff:10.0.0.5]:41000") == ipaddress.ip_address("10.0.0.5")
    assert peer_ip("unix:/tmp/socket") is None

    def own(address: str, peer: str) -> bool:
        return asyncio.run(own_relay_address(address, peer))

    assert own("10.0.0.5:7000", "ipv4:10.0.0.5:41000")  # any port on its own host
    assert own("10.0.0.5:7000", "ipv6:[::ffff:10.0.0.5]:41000")
    assert own("[::1]:7000", "ipv6:[::1]:41000")
    assert not own("10.0.0.6:7000", "ipv4:10.0.0.5:41000")  # another host: placing someone else in the tree
    assert not own("10.0.0.5:7000", "unix:/tmp/socket")


def test_the_trainer_gives_a_versions_digest_without_sending_weights_and_keeps_it_past_the_next_version():
    async def scenario():
        weights = WeightSyncServer(snapshot(1))
        server, address = await serve_weights(weights)
        client = WeightSyncClient(address)
        try:
            before_any_pull = await client.digest(1, torch.bfloat16)  # computed on demand from the snapshot
            sent_for_digest = weights.sent_bytes
            stream = client.stream(version=1, dtype=torch.bfloat16, peer=True)
            _ = [item async for item in stream]
            await weights.publish(snapshot(2))
            pulled = [item async for item in client.stream(version=2, peer=True)]
            kept = await client.digest(1, torch.bfloat16)  # the version is gone, its digest kept
            newest = await client.digest(2)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await client.digest(7)
            return before_any_pull, sent_for_digest, stream.digest(), kept, newest, len(pulled), unknown.value.code()
        finally:
            await client.close()
            await server.stop(0)

    before_any_pull, sent_for_digest, streamed, kept, newest, pulled, unknown = asyncio.run(scenario())
    assert sent_for_digest == 0
    assert before_any_pull == streamed == kept == digest_of(snapshot(1), torch.bfloat16, aliases=True)
    assert newest == digest_of(snapshot(2), None, aliases=True) and pulled == 5
    assert unknown == grpc.StatusCode.NOT_FOUND


def test_a_watch_whose_relay_address_is_not_its_own_host_stays_out_of_the_relay_tree(caplog):
    async def scenario():
        weights = WeightSyncServer(snapshot(1), fanout=1)
        server, address = await serve_weights(weights)
        clients = [WeightSyncClient(address) for _ in range(2)]
        try:
            # Joined first, it would be the trainer's one child and every later replica's parent.
            elsewhere = clients[0].watch(after_version=0, relay_address="10.9.9.9:6000")
            own = clients[1].watch(after_version=0, relay_address="127.0.0.1:6001")
            heard = [await elsewhere.read(), await own.read()]
            members = weights.members
            await weights.publish(snapshot(2))
            heard += [await elsewhere.read(), await own.read()]
            return members, [(h.version, h.source, h.relay) for h in heard]
        finally:
            for client in clients:
                await client.close()
            await server.stop(0)

    members, heard = asyncio.run(scenario())
    assert members == ("127.0.0.1:6001",)
    assert heard == [(1, "", False), (1, "", False), (2, "", False), (2, "", False)]
    refused = [r for r in caplog.records if r.getMessage() == "weight_relay_address_refused"]
    assert [getattr(r, "fields", {}).get("relay_address") for r in refused] == ["10.9.9.9:6000"]
