"""Fan-out: replicas relay a version down a tree, so the trainer sends it a fixed number of times."""

import asyncio
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from services.common.config import RunConfig
from services.common.pb import weights_pb2_grpc
from services.common.transport import weight_sync_tls
from services.common.transport.weightsync.auth import WeightSyncToken
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.relay import Relay, add_relay_to_server
from services.common.transport.weightsync.server import WeightSyncServer, relay_route
from services.common.transport.weightsync.snapshot import Snapshot
from services.rollout.follower import PolicyFollower
from services.rollout.service import relays
from tests.support.runs import run_config
from tests.support.servers import free_port, self_signed
from tests.support.waits import until
from tests.support.weights import wire_bytes

pytestmark = pytest.mark.integration


class DictEngine:
    """Keeps a copy of every tensor it is given, as an engine copies them into its parameters."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.weights[name] = tensor.clone()


def model(version: int) -> Snapshot:
    torch.manual_seed(version)
    shared = torch.randn(64, 1000)  # tied: sent once, loaded under both names
    tensors = [(f"layer{i}", torch.randn(300_000)) for i in range(4)]  # 1.2 MB each: several chunks
    return Snapshot(version, version, (("embed", shared), *tensors, ("head", shared), ("ids", torch.arange(5))))


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


def token_check(token: str) -> list[grpc.aio.ServerInterceptor]:
    return [WeightSyncToken(token)] if token else []


def bind(server: grpc.aio.Server, tls: grpc.ServerCredentials | None) -> int:
    where = f"127.0.0.1:{free_port()}"
    return server.add_secure_port(where, tls) if tls is not None else server.add_insecure_port(where)


async def trainer(
    snap: Snapshot, fanout: int, token: str = "", tls: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, WeightSyncServer, str]:
    impl = WeightSyncServer(snap, fanout=fanout)
    server = grpc.aio.server(interceptors=token_check(token))
    weights_pb2_grpc.add_WeightSyncServicer_to_server(impl, server)
    port = bind(server, tls)
    await server.start()
    return server, impl, f"127.0.0.1:{port}"


class Replica:
    """A rollout's weight path: its follower, its engine and its relay served on its own gRPC port."""

    def __init__(self, trainer_address: str, token: str = "", cfg: RunConfig | None = None):
        """With ``cfg``, TLS as a rollout of that run has it (weight_sync_tls): on its port and to every peer."""
        self.engine = DictEngine()
        self.relay = Relay()
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
    assert trainer_sent == wire_bytes(second)  # once, not three times
    assert relayed == [wire_bytes(second), wire_bytes(second), 0]
    assert origins == ["relay", "relay", "peer"]
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
                watches.append(client.watch(after_version=0, relay_address=f"10.0.0.{i}:1"))
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
    assert members == ("10.0.0.0:1", "10.0.0.2:1", "10.0.0.3:1")
    assert routes == [("", True), ("10.0.0.0:1", True), ("10.0.0.2:1", False)]


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
