"""The gRPC servers every service starts: a port is held by one process only."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import load_config
from services.common.service import start_grpc_server
from tests.conftest import write_config

pytestmark = pytest.mark.integration


def test_a_port_another_server_holds_fails_the_bind(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    cfg = load_config(write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs"))

    async def scenario():
        first, address = await start_grpc_server(cfg, 0)
        try:
            # gRPC's default SO_REUSEPORT would let this bind succeed and split the calls between two processes.
            with pytest.raises(OSError, match="cannot bind gRPC port"):
                await start_grpc_server(cfg, int(address.rpartition(":")[2]))
            async with grpc.aio.insecure_channel(address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await first.stop(None)

    asyncio.run(scenario())
