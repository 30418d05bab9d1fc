"""A fixed gRPC port held for a moment (another socket drew it) is bound once it is free; one held too long fails."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.common.config import load_config
from services.common.service import start_grpc_server
from tests.support.servers import free_port

pytestmark = pytest.mark.integration


def held(port: int) -> socket.socket:
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


@pytest.fixture
def cfg(tmp_path):
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return load_config(None, model={"path": str(model)}, data={"train_path": str(data / "train.jsonl")})


def test_a_port_freed_within_the_wait_is_bound_and_served(cfg):
    port = free_port()
    holder = held(port)

    async def scenario() -> str:
        loop = asyncio.get_running_loop()
        loop.call_later(0.6, holder.close)  # the other socket lets go while the server waits
        server, address = await start_grpc_server(cfg, port, bind_wait_s=10)
        await server.stop(grace=0)
        return address

    assert asyncio.run(scenario()) == f"{cfg.service.host}:{port}"


def test_a_port_held_past_the_wait_fails_naming_it(cfg):
    port = free_port()
    holder = held(port)
    try:
        with pytest.raises(OSError, match=f"cannot bind gRPC port {cfg.service.host}:{port}: in use"):
            asyncio.run(start_grpc_server(cfg, port, bind_wait_s=0.5))
    finally:
        holder.close()
