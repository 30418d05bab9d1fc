"""The admin port's transport: bearer token on every Admin call, TLS when configured, health open to probes."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import load_config
from services.common.pb import admin_pb2, admin_pb2_grpc
from services.trainer.admin import AdminServicer, SourceAllowlist, peer_address
from services.trainer.role import start_admin_server
from tests.support.paths import ROOT
from tests.support.runs import config_file
from tests.support.servers import self_signed
from tests.support.trainer import StatusOnly

pytestmark = pytest.mark.integration


def test_tls_admin_needs_the_token_and_answers_health_without_it(tiny_model, tmp_path, monkeypatch):
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("RLPIPE_ADMIN_TOKEN", "s3cret")
    config = config_file(
        tmp_path,
        tiny_model,
        service={"host": "localhost"},
        admin={"port": 0, "tls_cert": str(cert), "tls_key": str(key)},
    )
    cfg = load_config(config)
    credentials = grpc.ssl_channel_credentials(cert.read_bytes())

    async def scenario() -> str:
        servicer = AdminServicer(control=None, status=StatusOnly(), live=None, recovery=None)
        server, address = await start_admin_server(cfg, servicer)
        try:
            async with grpc.aio.secure_channel(address, credentials) as channel:
                admin = admin_pb2_grpc.AdminStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as wrong:
                    await admin.GetStatus(
                        admin_pb2.GetStatusRequest(), timeout=10, metadata=[("authorization", "Bearer s3cre")]
                    )
                assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
                status = await admin.GetStatus(
                    admin_pb2.GetStatusRequest(), timeout=10, metadata=[("authorization", "Bearer s3cret")]
                )
                assert (status.run_id, status.step) == ("tls", 7)
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            async with grpc.aio.insecure_channel(address) as plain:  # TLS is not optional once configured
                with pytest.raises(grpc.aio.AioRpcError) as cleartext:
                    await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert cleartext.value.code() == grpc.StatusCode.UNAVAILABLE
            return address
        finally:
            await server.stop(grace=0)

    assert asyncio.run(scenario()).startswith("localhost:")


def test_a_trainer_without_a_token_refuses_to_start(tiny_model, tmp_path):
    config = config_file(tmp_path, tiny_model)
    env = {"PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "services.trainer", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2
    assert "admin token" in done.stderr and "RLPIPE_ADMIN_TOKEN" in done.stderr


def test_an_admin_call_from_outside_the_allowed_sources_is_refused_whatever_token_it_carries(
    config_only_model, tmp_path, monkeypatch
):
    monkeypatch.setenv("RLPIPE_ADMIN_TOKEN", "s3cret")
    token = [("authorization", "Bearer s3cret")]

    async def calls_from_loopback(allowed: list[str]) -> list[grpc.StatusCode]:
        """GetStatus with the token, GetStatus without it and a health check, each over a real socket from 127.0.0.1."""
        config = config_file(
            tmp_path, config_only_model, service={"host": "0.0.0.0"}, admin={"port": 0, "allowed_sources": allowed}
        )
        servicer = AdminServicer(control=None, status=StatusOnly(), live=None, recovery=None)
        server, address = await start_admin_server(load_config(config), servicer)
        codes = []
        try:
            async with grpc.aio.insecure_channel(address.replace("0.0.0.0", "127.0.0.1")) as channel:
                admin = admin_pb2_grpc.AdminStub(channel)
                for metadata in (token, []):
                    try:
                        await admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=10, metadata=metadata)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as error:
                        codes.append(error.code())
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no allowlist entry
        finally:
            await server.stop(grace=0)
        return codes

    # The client's address is 127.0.0.1: outside 127.0.0.2/32 and 10.0.0.0/8, inside 127.0.0.0/8.
    refused = [grpc.StatusCode.PERMISSION_DENIED] * 2
    assert asyncio.run(calls_from_loopback(["127.0.0.2/32", "10.0.0.0/8"])) == refused
    admitted = [grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED]  # then the token decides
    assert asyncio.run(calls_from_loopback(["10.0.0.0/8", "127.0.0.0/8"])) == admitted


@pytest.mark.unit
@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:10.1.2.3:51234", "10.1.2.3"),
        ("ipv6:[::1]:51234", "::1"),
        ("ipv6:%5B::1%5D:51234", "::1"),  # percent-encoded, as some grpc releases write it
        ("ipv6:[::ffff:10.1.2.3]:51234", "10.1.2.3"),  # an IPv4 client on a dual-stack socket
        ("ipv6:[fe80::1%25eth0]:51234", "fe80::1"),  # a zone
        ("unix:/tmp/admin.sock", None),
        ("ipv4:not-an-address:1", None),
    ],
)
def test_the_callers_address_is_read_from_grpcs_peer_string(peer, address):
    found = peer_address(peer)
    assert (str(found) if found is not None else None) == address
    assert SourceAllowlist(["10.0.0.0/8"]).admits(peer) == (address == "10.1.2.3")
