"""A relay tree's pieces over real gRPC sockets: the trainer's WeightSync on a free port, and the model it serves."""

from __future__ import annotations

import grpc
import torch

from services.common.pb import weights_pb2_grpc
from services.common.transport.weightsync.auth import WeightSyncToken
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import Snapshot
from tests.support.servers import free_port


def model(version: int) -> Snapshot:
    torch.manual_seed(version)
    shared = torch.randn(64, 1000)  # tied: sent once, loaded under both names
    tensors = [(f"layer{i}", torch.randn(300_000)) for i in range(4)]  # 1.2 MB each: several chunks
    return Snapshot(version, version, (("embed", shared), *tensors, ("head", shared), ("ids", torch.arange(5))))


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
