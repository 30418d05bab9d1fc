"""What every service process starts: gRPC servers whose port is held by one process only, and its GPU watch."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.service import start_grpc_server
from tests.support.paths import ROOT
from tests.support.runs import config_file, run_config
from tests.support.servers import free_port, wait_for_port
from tests.support.telemetry import scrape

pytestmark = pytest.mark.integration


def test_a_port_another_server_holds_fails_the_bind(tiny_model, tmp_path):
    cfg = run_config(tmp_path, tiny_model)

    async def scenario():
        first, address = await start_grpc_server(cfg, 0)
        try:
            # gRPC's default SO_REUSEPORT would let this bind succeed and split the calls between two processes.
            with pytest.raises(OSError, match="cannot bind gRPC port"):
                await start_grpc_server(cfg, int(address.rpartition(":")[2]), bind_wait_s=0.5)
            async with grpc.aio.insecure_channel(address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await first.stop(None)

    asyncio.run(scenario())


FAKE_NVML_DIR = Path(__file__).parent / "fake_nvml"


@pytest.mark.parametrize("role", ["rollout", "reward", "reference"])
def test_each_role_exports_every_gpu_nvml_shows_it_and_its_own_gpu_memory_under_its_role(
    role, tiny_model, nats_url, tmp_path
):
    """The role's own process, NVML faked at the import (tests/common/fake_nvml first on PYTHONPATH): its metrics
    endpoint, up before the role waits for the run's streams, carries both GPUs' load and memory, labelled, and the
    memory NVML lists for the role's own process."""
    model_dir, _ = tiny_model
    port = free_port()
    config = config_file(
        tmp_path,
        tiny_model,
        model={"path": str(model_dir), "device": "cpu"},  # the fake shows GPUs CUDA cannot open
        nats={"url": nats_url},
        telemetry={"metrics_port": port},
    )
    # NVML lists the role's own process on GPU 0 with 300 MiB: its own GPU memory, beside the devices'.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_NVML_DIR), str(ROOT)]), "FAKE_NVML_SELF_MIB": "300"}
    process = subprocess.Popen(
        [sys.executable, "-m", f"services.{role}", "--config", str(config)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_port(port, process, role, timeout=60)
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        process.kill()
        _, stderr = process.communicate(timeout=30)
    gpus = {
        (sample.name, sample.labels["gpu"], sample.labels["uuid"]): sample.value
        for sample in samples
        if sample.name.startswith("rlpipe_gpu_") and sample.labels["role"] == role
    }
    a, b = "GPU-00000000-0000-0000-0000-00000000000a", "GPU-00000000-0000-0000-0000-00000000000b"
    assert gpus == {
        ("rlpipe_gpu_utilization_percent", "0", a): 87,
        ("rlpipe_gpu_utilization_percent", "1", b): 3,
        ("rlpipe_gpu_memory_used_bytes", "0", a): 100 * 2**30,
        ("rlpipe_gpu_memory_used_bytes", "1", b): 7 * 2**30,
        ("rlpipe_gpu_memory_total_bytes", "0", a): 140 * 2**30,
        ("rlpipe_gpu_memory_total_bytes", "1", b): 80 * 2**30,
    }, stderr[-2000:]
    assert '"event": "gpus_watched"' in stderr
    # Its own memory: NVML's figure for the process; no torch figures, as it never initialized CUDA.
    own = {
        sample.labels["kind"]: sample.value
        for sample in samples
        if sample.name == "rlpipe_role_gpu_memory_bytes" and sample.labels["role"] == role
    }
    assert own == {"used": 300 * 2**20}, stderr[-2000:]
