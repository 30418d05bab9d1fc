import asyncio

import grpc
import pytest
import torch

from services.common.pb import weights_pb2, weights_pb2_grpc
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import Snapshot, snapshot_of
from services.common.transport.weightsync.wire import (
    CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    ChecksumError,
    assemble,
    chunks_of,
    split_chunk,
)
from tests.support.servers import free_port
from tests.support.weights import serve_weights

pytestmark = pytest.mark.integration


def snapshot(version: int) -> Snapshot:
    torch.manual_seed(version)
    big = torch.randn(CHUNK_BYTES // 4 + 100)  # spans two chunks
    return Snapshot(
        version, version, (("big", big), ("half", torch.randn(3, 5).to(torch.bfloat16)), ("ids", torch.arange(7)))
    )


@pytest.mark.unit
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


async def serving(snap: Snapshot) -> tuple[grpc.aio.Server, WeightSyncServer, str]:
    impl = WeightSyncServer(snap)
    server, address = await serve_weights(impl)
    return server, impl, address


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64)
        self.proj = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("position_ids", torch.arange(16))


@pytest.mark.unit
def test_split_chunk_leaves_data_in_place_and_parses_the_rest():
    chunk = next(chunks_of(snapshot(3)))
    raw = chunk.SerializeToString()
    header, data = split_chunk(raw)
    assert data.obj is raw  # a view into the received message, not a copy
    assert bytes(data) == chunk.data and header.data == b""
    assert (header.name, header.version, header.offset, header.crc32) == ("big", 3, 0, chunk.crc32)
    assert header.tensor_bytes == (CHUNK_BYTES // 4 + 100) * 4


def test_pull_casts_floats_to_the_requested_dtype_and_leaves_integers():
    async def scenario():
        snap = snapshot(4)
        server, _, address = await serving(snap)
        client = WeightSyncClient(address)
        try:
            stream = client.stream(dtype=torch.bfloat16)
            tensors = {name: tensor async for name, tensor in stream}
        finally:
            await client.close()
            await server.stop(0)
        stored = dict(snap.tensors)
        assert tensors["big"].dtype == torch.bfloat16
        assert torch.equal(tensors["big"], stored["big"].to(torch.bfloat16))
        assert torch.equal(tensors["half"], stored["half"])
        assert tensors["ids"].dtype == torch.int64 and torch.equal(tensors["ids"], stored["ids"])
        assert stream.data_bytes == (CHUNK_BYTES // 4 + 100) * 2 + 15 * 2 + 7 * 8  # half the float32 bytes

    asyncio.run(scenario())


def test_tied_weights_are_copied_once_and_sent_once_under_both_names():
    model = TiedLM()
    snap = snapshot_of(model, version=5, step=5)
    stored = dict(snap.tensors)
    assert stored["head.weight"] is stored["embed.weight"]  # one host copy in the trainer
    assert [name for name, _ in snap.tensors] == list(model.state_dict())

    async def scenario():
        server, _, address = await serving(snap)
        client = WeightSyncClient(address)
        try:
            stream = client.stream()
            tensors = {name: tensor async for name, tensor in stream}
            # A client from before aliases (the generated stub, protobuf decoding) still gets every name.
            old_style = [c async for c in client.stub.PullWeights(weights_pb2.PullWeightsRequest())]
        finally:
            await client.close()
            await server.stop(0)
        return stream, tensors, old_style

    stream, tensors, old_style = asyncio.run(scenario())
    assert stream.version == 5 and set(tensors) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(tensors[name], tensor)
    embed_bytes = 300 * 64 * 4
    assert stream.data_bytes == snap.total_bytes - embed_bytes
    assert not any(c.aliases for c in old_style) and sum(len(c.data) for c in old_style) == snap.total_bytes
    version, old_tensors = assemble(old_style)
    assert version == 5 and set(old_tensors) == set(stored)


def test_chunk_size_is_the_clients_within_bounds_and_crcs_are_kept_per_version():
    async def scenario():
        snap = snapshot(6)
        server, _, address = await serving(snap)
        client = WeightSyncClient(address, chunk_bytes=1)  # below the floor: the server uses MIN_CHUNK_BYTES
        try:
            raw = [c async for c in client._pull(weights_pb2.PullWeightsRequest(chunk_bytes=1))]
            version, tensors = await client.pull()
        finally:
            await client.close()
            await server.stop(0)
        return snap, raw, version, tensors

    snap, raw, version, tensors = asyncio.run(scenario())
    big_bytes = (CHUNK_BYTES // 4 + 100) * 4
    assert len([r for r in raw if split_chunk(r)[0].name == "big"]) == -(-big_bytes // MIN_CHUNK_BYTES)
    assert set(snap.crcs) == {("None", MIN_CHUNK_BYTES, False), ("None", MIN_CHUNK_BYTES, True)}
    assert version == 6 and all(torch.equal(tensors[n], t) for n, t in snap.tensors)


def test_a_cast_is_made_once_per_version_and_shared_by_every_pull():
    async def scenario():
        snap = snapshot(7)
        server, impl, address = await serving(snap)
        client = WeightSyncClient(address)
        try:
            first = await client.pull(dtype=torch.bfloat16)
            casts = dict(snap.casts)
            second = await client.pull(dtype=torch.bfloat16)
            await impl.publish(snapshot(8))
            third = await client.pull(dtype=torch.bfloat16)
        finally:
            await client.close()
            await server.stop(0)
        return snap, casts, first, second, third, impl.latest

    snap, casts, first, second, third, latest = asyncio.run(scenario())
    big = dict(snap.tensors)["big"]
    # Only the float32 tensor needed a cast: bf16 goes as it is, integers are never cast.
    assert list(casts) == [(id(big), torch.bfloat16)]
    assert snap.cast_upto == {(id(big), torch.bfloat16): big.numel()}  # made once, in full, by the first pull
    assert snap.casts == casts and snap.casts[(id(big), torch.bfloat16)] is casts[(id(big), torch.bfloat16)]
    assert torch.equal(casts[(id(big), torch.bfloat16)], big.to(torch.bfloat16))
    assert first[0] == second[0] == 7 and torch.equal(first[1]["big"], second[1]["big"])
    # The next version brings its own casts; the old snapshot's go with it.
    new_big = dict(latest.tensors)["big"]
    assert list(latest.casts) == [(id(new_big), torch.bfloat16)]
    assert third[0] == 8 and torch.equal(third[1]["big"], new_big.to(torch.bfloat16))


def test_a_version_is_served_from_one_host_snapshot_while_the_trainer_keeps_training():
    """The trainer's optimizer steps change its model in place while replicas pull: every pull of a version,
    including one already streaming when the next version is published, gets the weights as they were when
    the version was made, out of the one copy the snapshot holds."""
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))  # 4.2 MB: several chunks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def train_step() -> None:
        optimizer.zero_grad()
        model(torch.randn(4, 512)).square().sum().backward()
        optimizer.step()

    made = {name: t.clone() for name, t in model.state_dict().items()}
    snap = snapshot_of(model, version=1, step=1)
    live = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert not live & {t.untyped_storage().data_ptr() for _, t in snap.tensors}  # a copy, not a view

    async def scenario():
        server, impl, address = await serving(snap)
        client = WeightSyncClient(address, chunk_bytes=MIN_CHUNK_BYTES)
        try:
            stream = client.stream()
            pulled = aiter(stream)
            first = [await anext(pulled)]  # the pull is under way...
            train_step()  # ...while the trainer trains on,
            await impl.publish(snapshot_of(model, version=2, step=2))  # and publishes the next version
            train_step()
            first += [item async for item in pulled]
            newer_version, newer = await client.pull()
            later_version, later = await client.pull(version=2)
        finally:
            await client.close()
            await server.stop(0)
        return stream.version, dict(first), newer_version, newer, later_version, later, impl.latest

    version, first, newer_version, newer, later_version, later, latest = asyncio.run(scenario())
    assert version == 1 and set(first) == set(made)
    for name, tensor in made.items():
        assert torch.equal(first[name], tensor), name  # version 1 as it was made, though the model moved twice
    stepped = dict(latest.tensors)
    assert any(not torch.equal(stepped[name], made[name]) for name in made)
    assert (newer_version, later_version) == (2, 2)
    for name in made:
        assert torch.equal(newer[name], stepped[name]) and torch.equal(later[name], stepped[name]), name
        assert not torch.equal(stepped[name], model.state_dict()[name]), name  # the second step is not in it
