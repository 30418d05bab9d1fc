"""Fan-out: replicas relay a version down a tree, so the trainer sends it a fixed number of times."""

import asyncio
import logging
import zlib
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from services.common.config import RunConfig
from services.common.pb import weights_pb2 as pb
from services.common.transport import weight_sync_tls
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.relay import Relay, add_relay_to_server
from services.common.transport.weightsync.server import WeightSyncServer, relay_route
from services.common.transport.weightsync.snapshot import Snapshot
from services.rollout.follower import PolicyFollower
from services.rollout.service import relays
from tests.support.relay_tree import bind, model, token_check, trainer
from tests.support.runs import run_config
from tests.support.servers import free_port, self_signed
from tests.support.waits import until
from tests.support.weights import wire_bytes

pytestmark = pytest.mark.integration


class DictEngine:
    """Keeps a copy of every tensor it is given, as an engine copies them into its parameters; counts its loads."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.loads = 0

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loads += 1
        for name, tensor in tensors:
            self.weights[name] = tensor.clone()


@pytest.mark.unit
def test_relay_route_is_a_complete_tree_under_the_trainer():
    plan = tuple("abcdefg")
    assert [relay_route(plan, a, 2) for a in plan] == [
        ("", True),  # a, b: the trainer's children
        ("", True),
        ("a", True),  # c, d under a; e, f under b; g under c
        ("a", False),
        ("b", False),
        ("b", False),
        ("c", False),
    ]
    assert [relay_route(plan[:4], a, 1) for a in plan[:4]] == [("", True), ("a", True), ("b", True), ("c", False)]
    assert relay_route(plan, "a", 0) == ("", False)  # fanout 0: everyone from the trainer
    assert relay_route(plan, "z", 2) == ("", False)  # joined after the version was published
    assert relay_route(("a",), "a", 2) == ("", False)  # nobody below it: nothing to keep


class ForgingRelay(Relay):
    """A compromised rollout's relay: what it serves its children is ``forge`` of each chunk it holds, with a CRC
    that fits (the chunks' CRCs are the sender's own)."""

    def __init__(self, flip_byte: bool = False, version: int | None = None):
        super().__init__()
        self.flip_byte, self.version = flip_byte, version

    def forge(self, raw: bytes) -> bytes:
        chunk = pb.WeightChunk.FromString(raw)
        if self.flip_byte and chunk.name == "layer2" and chunk.offset == 0:
            chunk.data = bytes([chunk.data[0] ^ 0x40]) + chunk.data[1:]
        if self.version is not None:
            chunk.version = self.version
        chunk.crc32 = zlib.crc32(chunk.data)
        return chunk.SerializeToString()

    async def PullWeights(  # type: ignore[override]
        self, request: pb.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for raw in super().PullWeights(request, context):
            yield self.forge(raw)


class Replica:
    """A rollout's weight path: its follower, its engine and its relay served on its own gRPC port."""

    def __init__(self, trainer_address: str, token: str = "", cfg: RunConfig | None = None, relay: Relay | None = None):
        """With ``cfg``, TLS as a rollout of that run has it (weight_sync_tls): on its port and to every peer;
        ``relay`` serves its peers in place of an honest one."""
        self.engine = DictEngine()
        self.relay = relay if relay is not None else Relay()
        self.server = grpc.aio.server(interceptors=token_check(token))
        add_relay_to_server(self.relay, self.server)
        tls = (
            weight_sync_tls.server_credentials(cfg.weight_sync, cfg.rollout, weight_sync_tls.ROLLOUT)
            if cfg is not None
            else None
        )
        self.address = f"127.0.0.1:{bind(self.server, tls)}"
        credentials = weight_sync_tls.channel_credentials(cfg.weight_sync) if cfg is not None else None
        options = weight_sync_tls.name_override(cfg.service) if cfg is not None else ()
        self.follower = PolicyFollower(
            self.engine,
            ThreadPoolExecutor(max_workers=1),
            WeightSyncClient(trainer_address, token=token, credentials=credentials, options=options),
            relay=self.relay,
            relay_address=self.address,
        )
        self.watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.server.start()
        self.watcher = asyncio.create_task(self.follower.watch())

    async def stop(self) -> None:
        assert self.watcher is not None
        self.watcher.cancel()
        await self.follower.close()
        await self.server.stop(0)


async def chain_and_sync(weights: WeightSyncServer, replicas: list[Replica], snapshot: Snapshot) -> int:
    """Starts ``replicas`` one by one (join order is the tree's order), publishes ``snapshot`` and syncs them, the
    leaf first; the bytes the trainer sent for it (relaying replicas pull as soon as they hear of the version)."""
    for count, replica in enumerate(replicas, 1):
        await replica.start()
        await until(lambda count=count: len(weights.members) == count)
    before = weights.sent_bytes
    await weights.publish(snapshot)
    await until(lambda: all(r.follower.newest == snapshot.version for r in replicas))
    await asyncio.gather(*(r.follower.sync() for r in reversed(replicas)))
    return weights.sent_bytes - before


def test_a_chain_of_replicas_gets_each_version_out_of_the_trainer_once():
    first, second = model(1), model(2)

    async def scenario():
        server, weights, address = await trainer(first, fanout=1)
        replicas = [Replica(address) for _ in range(3)]
        old_client = WeightSyncClient(address)
        try:
            for count, replica in enumerate(replicas, 1):  # one by one: join order is the tree's order
                await replica.start()
                await until(lambda count=count: len(weights.members) == count)
            assert weights.members == tuple(r.address for r in replicas)
            old_watch = old_client.watch(after_version=1)  # a client from before relaying: no address
            before = weights.sent_bytes  # relaying replicas start pulling as soon as they hear of the version
            await weights.publish(second)
            await until(lambda: all(r.follower.newest == 2 for r in replicas))
            heard = await asyncio.wait_for(old_watch.read(), timeout=5)
            # The leaf asks first: its parent is still pulling from its own parent, and forwards as it receives.
            await asyncio.gather(*(r.follower.sync() for r in reversed(replicas)))
            return (
                heard,
                weights.sent_bytes - before,
                [r.follower.announced for r in replicas],
                [r.follower.last_origin for r in replicas],
                [r.relay.sent_bytes for r in replicas],
                [r.relay.current for r in replicas],
                [r.follower.loaded for r in replicas],
                [r.engine.weights for r in replicas],
            )
        finally:
            old_watch.cancel()
            await old_client.close()
            for replica in replicas:
                await replica.stop()
            await server.stop(0)

    heard, trainer_sent, announced, origins, relayed, buffers, loaded, engines = asyncio.run(scenario())
    addresses = [a.source for a in announced]
    assert (heard.version, heard.source, heard.relay) == (2, "", False)
    assert [a.relay for a in announced] == [True, True, False]
    assert addresses[0] == "" and addresses[1] != addresses[2] != ""
    assert trainer_sent == wire_bytes(second)  # once, not three times: confirming the digest sent no weights
    assert relayed == [wire_bytes(second), wire_bytes(second), 0]
    assert origins == ["relay", "relay", "peer"]  # the second and third confirmed by digest, and counted
    assert buffers[2] is None and all(b is not None and b.complete and b.version == 2 for b in buffers[:2])
    assert loaded == [2, 2, 2]
    for weights in engines:
        assert set(weights) == {name for name, _ in second.tensors}
        assert all(torch.equal(weights[name], tensor) for name, tensor in second.tensors)


def test_with_the_runs_token_on_every_port_a_version_still_crosses_the_chain_through_the_relays():
    # A peer's pull carries the follower's token: without it the relay would refuse and each replica fall back
    # to the trainer, which would then send the version twice.
    async def scenario():
        server, weights, address = await trainer(model(1), fanout=1, token="run-token")
        replicas = [Replica(address, token="run-token") for _ in range(2)]
        try:
            trainer_sent = await chain_and_sync(weights, replicas, model(2))
            return (
                trainer_sent,
                [r.follower.last_origin for r in replicas],
                [r.follower.loaded for r in replicas],
            )
        finally:
            for replica in replicas:
                await replica.stop()
            await server.stop(0)

    trainer_sent, origins, loaded = asyncio.run(scenario())
    assert (trainer_sent, origins, loaded) == (wire_bytes(model(2)), ["relay", "peer"], [2, 2])


def test_under_tls_a_version_crosses_the_chain_through_the_relays_and_a_plaintext_peer_gets_nothing(
    tiny_model, tmp_path
):
    """The relay ports speak TLS with the trainer's certificate (weight_sync.tls_*), checked under the trainer's
    name though each is dialled at 127.0.0.1; a relay that served plaintext would make every peer pull fail and
    fall back to the trainer, which would then send the version twice."""
    cert, key = self_signed(tmp_path)  # names localhost
    cfg = run_config(
        tmp_path,
        tiny_model,
        service={"host": "0.0.0.0", "trainer_host": "localhost"},
        weight_sync={"tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(cert)},
    )

    async def scenario():
        tls = weight_sync_tls.server_credentials(cfg.weight_sync, cfg.rollout, weight_sync_tls.TRAINER)
        server, weights, address = await trainer(model(1), fanout=1, token="run-token", tls=tls)
        replicas = [Replica(address, token="run-token", cfg=cfg) for _ in range(3)]
        plaintext = WeightSyncClient(replicas[0].address, token="run-token")
        try:
            trainer_sent = await chain_and_sync(weights, replicas, model(2))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await plaintext.pull(version=2)
            return (
                trainer_sent,
                [r.follower.last_origin for r in replicas],
                [r.follower.loaded for r in replicas],
                [r.relay.sent_bytes for r in replicas],
                refused.value.code(),
                [r.engine.weights for r in replicas],
            )
        finally:
            await plaintext.close()
            for replica in replicas:
                await replica.stop()
            await server.stop(0)

    trainer_sent, origins, loaded, relayed, plaintext_code, engines = asyncio.run(scenario())
    assert trainer_sent == wire_bytes(model(2))  # once: the others came through the TLS relays
    assert (origins, loaded) == (["relay", "relay", "peer"], [2, 2, 2])
    assert relayed == [wire_bytes(model(2)), wire_bytes(model(2)), 0]  # nothing to the plaintext client
    assert plaintext_code == grpc.StatusCode.UNAVAILABLE
    for got in engines:
        assert all(torch.equal(got[name], tensor) for name, tensor in model(2).tensors)


def test_a_replica_whose_parent_is_gone_pulls_from_the_trainer():
    first, second = model(1), model(2)

    async def scenario():
        server, weights, address = await trainer(first, fanout=1)
        # A replica that joined, then lost its relay port (its pod died, the watch not yet timed out).
        gone = WeightSyncClient(address)
        gone_address = f"127.0.0.1:{free_port()}"
        gone_watch = gone.watch(after_version=0, relay_address=gone_address)
        await gone_watch.read()
        replica = Replica(address)
        try:
            await replica.start()
            await until(lambda: len(weights.members) == 2)
            before = weights.sent_bytes
            await weights.publish(second)
            await until(lambda: replica.follower.newest == 2)
            await replica.follower.sync()
            return (
                gone_address,
                replica.follower.announced,
                replica.follower.last_origin,
                replica.follower.loaded,
                replica.follower.torn,
                weights.sent_bytes - before,
                replica.engine.weights,
            )
        finally:
            gone_watch.cancel()
            await gone.close()
            await replica.stop()
            await server.stop(0)

    gone_address, announced, origin, loaded, torn, trainer_sent, weights = asyncio.run(scenario())
    assert (announced.source, announced.relay) == (gone_address, False)
    assert (origin, loaded, torn) == ("trainer", 2, False)
    assert trainer_sent == wire_bytes(second)
    assert all(torch.equal(weights[name], tensor) for name, tensor in second.tensors)


def test_a_replica_that_leaves_drops_out_of_the_next_tree():
    async def scenario():
        server, weights, address = await trainer(model(1), fanout=1)
        clients = [WeightSyncClient(address) for _ in range(4)]
        watches = []
        try:
            for i, client in enumerate(clients):  # one by one: join order is the tree's order
                watches.append(client.watch(after_version=0, relay_address=f"127.0.0.1:{6000 + i}"))
                await watches[-1].read()
            await until(lambda: len(weights.members) == 4)
            watches[1].cancel()  # the chain's second link goes away
            await until(lambda: len(weights.members) == 3)
            members = weights.members
            await weights.publish(model(2))
            stayed = [watches[0], watches[2], watches[3]]
            return members, [(a.source, a.relay) for a in [await w.read() for w in stayed]]
        finally:
            for watch in watches:
                watch.cancel()
            for client in clients:
                await client.close()
            await server.stop(0)

    members, routes = asyncio.run(scenario())
    assert members == ("127.0.0.1:6000", "127.0.0.1:6002", "127.0.0.1:6003")
    assert routes == [("", True), ("127.0.0.1:6000", True), ("127.0.0.1:6002", False)]


@pytest.mark.unit
def test_a_replica_that_peers_would_dial_by_tls_but_has_no_certificate_to_serve_does_not_relay(
    config_only_model, tmp_path
):
    cert, key = self_signed(tmp_path)

    def rollout_config(**weight_sync: str) -> RunConfig:
        return run_config(tmp_path, config_only_model, weight_sync=weight_sync)

    assert not relays(rollout_config(tls_ca=str(cert)))  # its pulls from the trainer are TLS all the same
    assert relays(rollout_config(tls_ca=str(cert), tls_cert=str(cert), tls_key=str(key)))
    assert relays(rollout_config())  # no TLS anywhere: a plaintext relay, as before


def forged_events(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "weight_relay_forged"]


def test_weights_a_relay_altered_are_not_served_by_its_subtree_which_reloads_them_from_the_trainer(caplog):
    """A compromised rollout at the top of a chain flips a bit of one tensor and fixes the CRC: its child (a relay,
    which forwards the same chunks on) and its grandchild each load it, find the digest is not the trainer's, stay
    torn meanwhile and load the version from the trainer."""
    caplog.set_level(logging.INFO)

    async def scenario():
        server, weights, address = await trainer(model(1), fanout=1)
        forger = Replica(address, relay=ForgingRelay(flip_byte=True))
        replicas = [forger, Replica(address), Replica(address)]
        attempts: list[list[tuple[bool, bool]]] = [[], []]  # per replica below the forger: (loaded, torn after)
        try:
            for replica, seen in zip(replicas[1:], attempts, strict=True):
                original = replica.follower._load

                async def load(stream, last, peer="", original=original, follower=replica.follower, seen=seen):
                    counted = await original(stream, last, peer)
                    seen.append((counted, follower.torn))
                    return counted

                replica.follower._load = load
            for count, replica in enumerate(replicas, 1):
                await replica.start()
                await until(lambda count=count: len(weights.members) == count)
            await weights.publish(model(2))
            await until(lambda: all(r.follower.newest == 2 for r in replicas))
            for replica in reversed(replicas):  # one by one: the leaf reads the middle relay before it drops it
                await replica.follower.sync()
            return (
                [r.follower.announced.source for r in replicas],
                [r.follower.last_origin for r in replicas],
                [(r.follower.loaded, r.follower.newest, r.follower.torn) for r in replicas],
                [r.engine.loads for r in replicas],
                [r.engine.weights for r in replicas],
                replicas[1].relay.current,
                attempts,
            )
        finally:
            for replica in replicas:
                await replica.stop()
            await server.stop(0)

    sources, origins, states, loads, engines, middle_buffer, attempts = asyncio.run(scenario())
    assert sources[0] == "" and sources[1] != sources[2] != ""
    assert origins == ["relay", "trainer", "trainer"]  # the forger loaded its own honest copy
    assert states == [(2, 2, False)] * 3
    assert loads == [1, 2, 2]  # the forged weights, then the trainer's
    assert attempts == [[(False, True), (True, False)]] * 2  # torn on the forged weights until the trainer's load
    for weights in engines:
        assert all(torch.equal(weights[name], tensor) for name, tensor in model(2).tensors)
    # The middle replica's relay drops what it cannot vouch for: no later child is served it.
    assert middle_buffer is not None and middle_buffer.done and middle_buffer.error is not None
    assert not middle_buffer.chunks
    forged = forged_events(caplog)
    assert {(e["peer"], e["version"]) for e in forged} == {(sources[1], 2), (sources[2], 2)}


def test_a_relay_that_stamps_a_huge_version_is_refused_before_loading_and_the_child_is_not_pinned_to_it(caplog):
    """Version 2**62 on valid chunks would, once loaded, make the child's newest version one the trainer never
    reaches: it would never sync again."""
    caplog.set_level(logging.INFO)
    huge = 1 << 62

    async def scenario():
        server, weights, address = await trainer(model(1), fanout=1)
        forger, child = Replica(address, relay=ForgingRelay(version=huge)), Replica(address)
        try:
            await chain_and_sync(weights, [forger, child], model(2))
            first = (child.follower.loaded, child.follower.newest, child.follower.last_origin, child.engine.loads)
            await weights.publish(model(3))  # and it goes on following the trainer
            await until(lambda: child.follower.newest == 3)
            await child.follower.sync()
            return first, (child.follower.loaded, child.follower.newest, child.follower.torn), child.engine.weights
        finally:
            for replica in (forger, child):
                await replica.stop()
            await server.stop(0)

    first, later, engine = asyncio.run(scenario())
    assert first == (2, 2, "trainer", 1)  # the forged stream never reached the engine
    assert later == (3, 3, False)
    assert all(torch.equal(engine[name], tensor) for name, tensor in model(3).tensors)
    # The forger is still in the tree at version 3: refused again.
    refused = [(e["version"], f"sent version {huge}" in e["reason"]) for e in forged_events(caplog)]
    assert refused == [(2, True), (3, True)]
