import asyncio

import grpc
import pytest
import torch

from services.common.pb import weights_pb2_grpc
from services.common.weightsync import (
    CHUNK_BYTES,
    ChecksumError,
    Snapshot,
    WeightSyncClient,
    WeightSyncServer,
    assemble,
    chunks_of,
)
from tests.conftest import free_port


def snapshot(version: int) -> Snapshot:
    torch.manual_seed(version)
    big = torch.randn(CHUNK_BYTES // 4 + 100)  # spans two chunks
    return Snapshot(
        version, version, (("big", big), ("half", torch.randn(3, 5).to(torch.bfloat16)), ("ids", torch.arange(7)))
    )


def test_chunks_reassemble_bit_exact_and_catch_corruption():
    snap = snapshot(1)
    chunks = list(chunks_of(snap))
    assert len([c for c in chunks if c.name == "big"]) == 2
    version, tensors = assemble(chunks)
    assert version == 1
    for name, tensor in snap.tensors:
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor)
    chunks[0].data = bytes([chunks[0].data[0] ^ 1]) + chunks[0].data[1:]
    with pytest.raises(ChecksumError, match="CRC-32"):
        assemble(chunks)
    fresh = list(chunks_of(snap))
    with pytest.raises(ChecksumError, match="out of order"):
        assemble(fresh[1:])
    with pytest.raises(ChecksumError, match="bytes"):
        assemble(fresh[:1] + fresh[2:])


def test_watch_and_pull_over_a_real_socket():
    async def scenario():
        server_impl = WeightSyncServer(snapshot(0))
        server = grpc.aio.server()
        weights_pb2_grpc.add_WeightSyncServicer_to_server(server_impl, server)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await server.start()
        client = WeightSyncClient(f"127.0.0.1:{port}")
        try:
            assert (await client.version()).version == 0
            watch = client.watch(after_version=0)
            await server_impl.publish(snapshot(2))
            seen = await asyncio.wait_for(watch.read(), timeout=5)
            assert seen.version == 2 and seen.num_tensors == 3
            version, tensors = await client.pull()
            assert version == 2 and torch.equal(tensors["big"], snapshot(2).tensors[0][1])
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await client.pull(version=1)
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
            watch.cancel()
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(scenario())
