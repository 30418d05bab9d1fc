"""The Admin ``Scale`` call: a local run stores the count for its launcher and answers with the counts before and
after; a bad request is INVALID_ARGUMENT naming why; where an orchestrator owns the replicas (Kubernetes, compose)
the call is refused naming where to scale, and `rlpipe scale` says so with exit 1, storing nothing."""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass

import grpc
import nats
import pytest

from services.common.config import RunConfig, load_config
from services.common.pb import admin_pb2, admin_pb2_grpc
from services.common.transport.live_config import LiveConfig
from services.common.transport.scale import read_scale
from services.trainer.admin import AdminServicer
from services.trainer.control import RunState
from services.trainer.role import start_admin_server
from tests.support.paths import ROOT
from tests.support.runs import RLPIPE, config_file

pytestmark = pytest.mark.integration
TOKEN = "scale-token"


@dataclass
class StateOnly:
    """The trainer's control as the Scale call reads it: the run's state."""

    state: RunState = RunState.RUNNING


@dataclass
class Seen:
    role: str
    up: bool = True


@dataclass
class Services:
    """The status reporter as the Scale call reads it: the replicas registered (none by default)."""

    seen: tuple[Seen, ...] = ()

    async def refresh_services(self, max_age_s: float = 5.0) -> list[Seen]:
        return list(self.seen)


async def serving(cfg: RunConfig, nats_url: str, call, services: Services | None = None):
    """``call(admin stub, metadata, address)`` against an Admin server over ``cfg``'s config bucket; its result
    and the counts stored."""
    nc = await nats.connect(nats_url)
    try:
        live = await LiveConfig(cfg, nc.jetstream()).start()
        status = services or Services()
        servicer = AdminServicer(control=StateOnly(), status=status, live=live, recovery=None)
        server, address = await start_admin_server(cfg, servicer)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                result = await call(admin_pb2_grpc.AdminStub(channel), [("authorization", f"Bearer {TOKEN}")], address)
        finally:
            await server.stop(grace=0)
        return result, await read_scale(live.kv)
    finally:
        await nc.close()


@pytest.fixture
def config(config_only_model, tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_ADMIN_TOKEN", TOKEN)
    return config_file(tmp_path, config_only_model, run_id="scale", admin={"port": 0})


def test_a_local_run_stores_the_count_for_its_launcher_and_refuses_bad_requests_naming_why(config, nats_url):
    cfg = load_config(config, supervision={"scaler": "launcher", "max_replicas": 4})

    async def calls(admin, metadata, address):
        up = await admin.Scale(admin_pb2.ScaleRequest(role="rollout", replicas=3, author="alice"), metadata=metadata)
        down = await admin.Scale(admin_pb2.ScaleRequest(role="rollout", replicas=2, author="bob"), metadata=metadata)
        refusals = []
        for role, replicas in (("trainer", 2), ("critic", 1), ("reward", -1), ("reward", 5)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await admin.Scale(admin_pb2.ScaleRequest(role=role, replicas=replicas), metadata=metadata)
            refusals.append((refused.value.code(), refused.value.details()))
        return up, down, refusals

    (up, down, refusals), stored = asyncio.run(serving(cfg, nats_url, calls))
    assert (up.role, up.replicas_before, up.replicas, up.replicas_up) == ("rollout", 1, 3, 0)
    assert (down.replicas_before, down.replicas) == (3, 2)
    assert (stored["rollout"].replicas, stored["rollout"].author) == (2, "bob") and stored.keys() == {"rollout"}
    assert {code for code, _ in refusals} == {grpc.StatusCode.INVALID_ARGUMENT}
    said = [details for _, details in refusals]
    assert "the trainer does not scale" in said[0] and "unknown role 'critic'" in said[1]
    assert "a count is 0 or more" in said[2] and "supervision.max_replicas (4)" in said[3]


def test_with_rollout_replicas_auto_the_count_before_is_the_replicas_the_placement_started(config, nats_url):
    cfg = load_config(config, supervision={"scaler": "launcher"}, rollout={"replicas": "auto"})
    started = Services((Seen("rollout"), Seen("rollout"), Seen("reward")))

    async def calls(admin, metadata, address):
        return await admin.Scale(admin_pb2.ScaleRequest(role="rollout", replicas=3), metadata=metadata)

    up, stored = asyncio.run(serving(cfg, nats_url, calls, started))
    assert (up.replicas_before, up.replicas, up.replicas_up) == (2, 3, 2)
    assert stored["rollout"].replicas == 3


def test_where_an_orchestrator_owns_the_replicas_rlpipe_scale_names_where_to_scale_and_stores_nothing(config, nats_url):
    cfg = load_config(config)  # supervision.scaler: orchestrator, as a trainer outside `rlpipe run` has it

    async def calls(admin, metadata, address):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admin.Scale(admin_pb2.ScaleRequest(role="rollout", replicas=3), metadata=metadata)
        command = [*RLPIPE, "--address", address, "--token", TOKEN, "scale", "reward", "2"]
        cli = await asyncio.to_thread(subprocess.run, command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        return refused.value, cli

    (refused, cli), stored = asyncio.run(serving(cfg, nats_url, calls))
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kubectl scale deployment/rollout --replicas=3" in refused.details()
    assert cli.returncode == 1, cli.stderr
    message = " ".join(cli.stderr.split())
    assert "Scale: FAILED_PRECONDITION" in message and "docker compose up -d --scale reward=2" in message
    assert stored == {}
