"""`python -m services.cli.healthcheck`, the probe the images' HEALTHCHECK and compose run."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.support.paths import ROOT
from tests.support.servers import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.healthcheck", *args], cwd=ROOT, capture_output=True, text=True, timeout=30
    )


def test_serving_server_passes(health_server):
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    done = probe(address, "--timeout", "5")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_not_serving_fails_with_the_status(health_server):
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    done = probe(address)
    assert done.returncode == 1
    assert done.stderr.strip() == f"unhealthy: {address}: NOT_SERVING"


def test_named_service_is_checked(health_server):
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("rlpipe.Admin", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert probe(address, "--service", "rlpipe.Admin").returncode == 1
    unknown = probe(address, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_nothing_listening_fails_in_one_line():
    done = probe(f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert done.returncode == 1
    assert done.stderr.startswith("unhealthy: ") and "UNAVAILABLE" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
