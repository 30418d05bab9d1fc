"""The read-only admin token on a real Admin port: it reads the run, it changes nothing, and it rotates like the
admin token; `rlpipe --read-only` calls with it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
from pathlib import Path

import grpc
import pytest

from services.common.observe.events import Journal
from services.common.pb import admin_pb2, admin_pb2_grpc
from services.trainer.admin import AdminServicer
from services.trainer.control import Control, RunState
from services.trainer.progress import Progress
from services.trainer.role import start_admin_server
from tests.support.paths import ROOT
from tests.support.runs import RLPIPE, run_config
from tests.support.trainer import Holds

pytestmark = pytest.mark.integration

ADMIN, READ, ROTATED_READ = "LEAKED-admin-token", "LEAKED-read-token", "LEAKED-rotated-read-token"


class ControlStatus:
    """The status reporter as these calls read it: the run's state, which the real ``Control`` moves."""

    def __init__(self, control: Control):
        self.control = control

    async def status(self) -> admin_pb2.Status:
        return admin_pb2.Status(run_id="read", state=self.control.state.value, step=3)


async def training_loop(control: Control) -> None:
    """What the trainer's loop does with operator commands between steps: run them when woken."""
    while True:
        await control.wakeup.wait()
        await control.run_commands()


def rewrite(path: Path, token: str, bump_ns: int) -> None:
    """A rotation: the new token, with the mtime moved on so a rewrite within one clock tick is still seen."""
    path.write_text(token + "\n")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + bump_ns))


async def call(admin: admin_pb2_grpc.AdminStub, method: str, request, token: str) -> tuple[grpc.StatusCode, str]:
    try:
        await getattr(admin, method)(request, metadata=(("authorization", f"Bearer {token}"),), timeout=10)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def test_the_read_token_reads_the_run_is_refused_every_change_and_rotates_like_the_admin_token(
    config_only_model, tmp_path, monkeypatch, caplog
):
    monkeypatch.delenv("RLPIPE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("RLPIPE_ADMIN_READ_TOKEN", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "admin.token").write_text(ADMIN + "\n")
    read_file = run_dir / "admin-read.token"
    read_file.write_text(READ + "\n")
    cfg = run_config(
        tmp_path,
        config_only_model,
        admin={"port": 0, "token_file": str(run_dir / "admin.token"), "read_token_file": str(read_file)},
    )
    control = Control(Holds(), Journal(), Progress(step=3))
    status, pause = admin_pb2.GetStatusRequest(), admin_pb2.PauseRequest(reason="from a dashboard")

    async def scenario() -> dict[str, object]:
        servicer = AdminServicer(control=control, status=ControlStatus(control), live=None, recovery=None)
        server, address = await start_admin_server(cfg, servicer)
        loop = asyncio.create_task(training_loop(control))
        seen: dict[str, object] = {}
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                admin = admin_pb2_grpc.AdminStub(channel)
                seen["read status"] = await call(admin, "GetStatus", status, READ)
                seen["read pause"] = await call(admin, "Pause", pause, READ)
                seen["state after the read pause"] = control.state
                seen["read stop"] = await call(admin, "Stop", admin_pb2.StopRequest(), READ)
                seen["wrong token"] = await call(admin, "GetStatus", status, "not-a-token")
                seen["the CLI, read-only"] = await rlpipe(address, run_dir, "--read-only", "status", "--json")
                seen["the CLI, read-only pause"] = await rlpipe(address, run_dir, "--read-only", "pause")
                seen["state after the CLI"] = control.state
                seen["admin pause"] = await call(admin, "Pause", pause, ADMIN)
                seen["state after the admin pause"] = control.state
                rewrite(read_file, ROTATED_READ, 1_000_000)
                seen["old read token"] = await call(admin, "GetStatus", status, READ)
                seen["new read token"] = await call(admin, "GetStatus", status, ROTATED_READ)
                seen["new read token resumes"] = await call(admin, "Resume", admin_pb2.ResumeRequest(), ROTATED_READ)
                seen["state at the end"] = control.state
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
            await server.stop(None)
        return seen

    caplog.set_level(logging.INFO)
    seen = asyncio.run(scenario())
    ok = (grpc.StatusCode.OK, "")
    assert seen["read status"] == ok
    code, details = seen["read pause"]
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == "the read-only token may not call Pause: it needs the admin token"
    assert seen["state after the read pause"] == RunState.RUNNING  # refused before the command was queued
    assert seen["read stop"][0] == grpc.StatusCode.PERMISSION_DENIED and "Stop" in seen["read stop"][1]
    assert seen["wrong token"][0] == grpc.StatusCode.UNAUTHENTICATED

    status_cli, pause_cli = seen["the CLI, read-only"], seen["the CLI, read-only pause"]
    assert status_cli.returncode == 0, status_cli.stderr
    assert '"state": "running"' in status_cli.stdout
    assert pause_cli.returncode == 1, pause_cli.stderr  # refused, not "token refused" (4): the token is good
    assert "Pause: PERMISSION_DENIED: the read-only token may not call Pause" in " ".join(pause_cli.stderr.split())
    assert seen["state after the CLI"] == RunState.RUNNING

    assert seen["admin pause"] == ok and seen["state after the admin pause"] == RunState.PAUSED
    assert seen["old read token"][0] == grpc.StatusCode.UNAUTHENTICATED  # rotated out, from the next call on
    assert seen["new read token"] == ok
    assert seen["new read token resumes"][0] == grpc.StatusCode.PERMISSION_DENIED
    assert seen["state at the end"] == RunState.PAUSED

    refusals = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "admin_read_only_refused"]
    assert [fields["method"] for fields in refusals] == ["Pause", "Stop", "Pause", "Resume"]
    rotated = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "admin_token_rotated"]
    assert rotated == [{"field": "admin.read_token_file", "path": str(read_file)}]
    # No token in any error, log line or CLI output.
    said = [details for code_and_details in seen.values() if isinstance(code_and_details, tuple)]
    said += [pause_cli.stderr, pause_cli.stdout, status_cli.stderr, status_cli.stdout]
    said += [r.getMessage() + repr(getattr(r, "fields", {})) for r in caplog.records]
    assert not [text for text in said for token in (ADMIN, READ, ROTATED_READ) if token in str(text)]


async def rlpipe(address: str, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`rlpipe --address ADDRESS --run-dir RUN_DIR ARGS...` off the event loop that serves the call."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_ADMIN")}  # the token comes from run_dir
    command = [*RLPIPE, "--address", address, "--run-dir", str(run_dir), *args]
    return await asyncio.to_thread(
        subprocess.run, command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
