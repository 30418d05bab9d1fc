"""WeightSync's auth layer over real gRPC sockets: the run's token on every call to the trainer and to a relay, relay
addresses from authenticated rollouts only, TLS when configured."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from services.common.config import load_config
from services.common.pb import weights_pb2_grpc
from services.common.refusal import StartRefused
from services.common.service import start_grpc_server
from services.common.transport.weight_sync_tls import TRAINER, channel_credentials, server_credentials
from services.common.transport.weightsync.auth import (
    WeightSyncToken,
    server_interceptors,
)
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.relay import Relay, add_relay_to_server
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import Snapshot
from tests.support.runs import config_file, run_config
from tests.support.servers import self_signed

pytestmark = pytest.mark.integration

TOKEN = "the-runs-weight-sync-token"


def snapshot(version: int) -> Snapshot:
    return Snapshot(version, version, (("w", torch.arange(64, dtype=torch.float32)),))


async def serving(interceptors: list[grpc.aio.ServerInterceptor]) -> tuple[grpc.aio.Server, WeightSyncServer, str]:
    impl = WeightSyncServer(snapshot(1))
    server = grpc.aio.server(interceptors=interceptors)
    weights_pb2_grpc.add_WeightSyncServicer_to_server(impl, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, impl, f"127.0.0.1:{port}"


async def refusal(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value.code()


def test_a_client_without_the_token_or_with_a_wrong_one_is_refused_unauthenticated_and_gets_no_bytes():
    async def scenario() -> None:
        server, impl, address = await serving([WeightSyncToken(TOKEN)])
        clients = {token: WeightSyncClient(address, token=token) for token in ("", "wrong", TOKEN)}
        try:
            for token in ("", "wrong"):
                assert await refusal(clients[token].version()) == grpc.StatusCode.UNAUTHENTICATED
                assert await refusal(clients[token].pull()) == grpc.StatusCode.UNAUTHENTICATED
            assert impl.sent_bytes == 0
            version, tensors = await clients[TOKEN].pull()
            assert version == 1 and torch.equal(tensors["w"], torch.arange(64, dtype=torch.float32))
            assert impl.sent_bytes == 64 * 4
        finally:
            for client in clients.values():
                await client.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_relay_registration_without_the_token_is_refused_and_never_enters_the_relay_tree():
    async def scenario() -> None:
        server, impl, address = await serving([WeightSyncToken(TOKEN)])
        stranger, rollout = WeightSyncClient(address, token="wrong"), WeightSyncClient(address, token=TOKEN)
        try:
            refused = stranger.watch(after_version=1, relay_address="10.9.9.9:6000")
            assert await refusal(refused.read()) == grpc.StatusCode.UNAUTHENTICATED
            joined = rollout.watch(after_version=1, relay_address="127.0.0.1:6000")  # its own host, any port
            await impl.publish(snapshot(2))  # fixes this version's tree from the open watch streams
            announced = await asyncio.wait_for(joined.read(), timeout=10)
            assert announced.version == 2 and announced.source == ""
            assert impl.members == ("127.0.0.1:6000",)
            joined.cancel()
        finally:
            await stranger.close()
            await rollout.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_rollouts_relay_port_refuses_a_pull_without_the_token(tiny_model, tmp_path):
    cfg = run_config(tmp_path, tiny_model)

    async def scenario() -> None:
        relay = Relay()
        server, address = await start_grpc_server(
            cfg, 0, register=lambda s: [add_relay_to_server(relay, s)], interceptors=[WeightSyncToken(TOKEN)]
        )
        peer = WeightSyncClient(address)
        try:
            assert await refusal(peer.pull(version=1)) == grpc.StatusCode.UNAUTHENTICATED
            assert relay.sent_bytes == 0
        finally:
            await peer.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_with_tls_configured_a_plaintext_client_fails_and_a_tls_client_with_the_token_pulls(
    tiny_model, tmp_path, monkeypatch
):
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("RLPIPE_WEIGHTSYNC_TOKEN", TOKEN)
    config = config_file(
        tmp_path,
        tiny_model,
        service={"host": "localhost"},
        weight_sync={"tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(cert)},
    )
    cfg = load_config(config)

    async def scenario() -> None:
        impl = WeightSyncServer(snapshot(1))

        def register(server: grpc.aio.Server) -> list[str]:
            weights_pb2_grpc.add_WeightSyncServicer_to_server(impl, server)
            return ["rlpipe.v1.WeightSync"]

        server, address = await start_grpc_server(
            cfg,
            0,
            register,
            interceptors=server_interceptors(cfg.environment),
            credentials=server_credentials(cfg.weight_sync, cfg.rollout, TRAINER),
        )
        plaintext = WeightSyncClient(address, token=TOKEN)
        secure = WeightSyncClient(address, token=TOKEN, credentials=channel_credentials(cfg.weight_sync))
        try:
            assert await refusal(plaintext.version(timeout=3)) == grpc.StatusCode.UNAVAILABLE
            assert impl.sent_bytes == 0
            version, _ = await secure.pull()
            assert version == 1 and impl.sent_bytes == 64 * 4
        finally:
            await plaintext.close()
            await secure.close()
            await server.stop(0)

    asyncio.run(scenario())


@pytest.mark.unit
def test_a_prod_trainer_without_a_weight_sync_token_refuses_to_start(config_only_model, tmp_path, monkeypatch):
    monkeypatch.delenv("RLPIPE_WEIGHTSYNC_TOKEN", raising=False)
    monkeypatch.delenv("RLPIPE_ENV", raising=False)
    cfg = run_config(tmp_path, config_only_model, environment="prod")
    with pytest.raises(StartRefused, match="RLPIPE_WEIGHTSYNC_TOKEN is not set"):
        server_interceptors(cfg.environment)
    assert server_interceptors("dev") == []
