"""Rotating the admin token: rewrite admin.token_file and the running trainer's admin port takes the new one."""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
import pytest

from services.common.pb import admin_pb2, admin_pb2_grpc
from services.trainer.admin import AdminServicer, AdminToken
from services.trainer.role import start_admin_server
from tests.support.runs import run_config
from tests.support.trainer import StatusOnly

pytestmark = pytest.mark.integration


def test_rewritten_token_file_rotates_the_token_without_a_restart(tiny_model, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("RLPIPE_ADMIN_TOKEN", raising=False)
    token_file = tmp_path / "admin.token"
    token_file.write_text("first-token\n")
    cfg = run_config(tmp_path, tiny_model, admin={"port": 0, "token_file": str(token_file)})

    async def status_code(admin: admin_pb2_grpc.AdminStub, token: str) -> grpc.StatusCode:
        try:
            await admin.GetStatus(
                admin_pb2.GetStatusRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=10
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    async def scenario() -> list[grpc.StatusCode]:
        servicer = AdminServicer(control=None, status=StatusOnly(), live=None, recovery=None)
        server, address = await start_admin_server(cfg, servicer)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                admin = admin_pb2_grpc.AdminStub(channel)
                codes = [await status_code(admin, "first-token")]
                token_file.write_text("second-token\n")
                # A rewrite within the same clock tick as the first write must still be seen: bump the mtime.
                stat = token_file.stat()
                os.utime(token_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
                codes += [await status_code(admin, "first-token"), await status_code(admin, "second-token")]
                token_file.write_text("")  # half-way through a rewrite: the token in force stands
                codes.append(await status_code(admin, "second-token"))
                token_file.write_text("third-token\nLEAKED-line\n")  # two tokens: neither is taken, none quoted
                stat = token_file.stat()
                os.utime(token_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000))
                codes.append(await status_code(admin, "second-token"))
                return codes
        finally:
            await server.stop(None)

    caplog.set_level(logging.INFO)
    assert asyncio.run(scenario()) == [
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OK,
        grpc.StatusCode.OK,
        grpc.StatusCode.OK,
    ]
    [refused] = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "admin_token_unreadable"]
    assert refused["error"].startswith("admin.token_file: the token in") and "holds a line break" in refused["error"]
    assert not [r for r in caplog.records if "LEAKED" in r.getMessage() + repr(getattr(r, "fields", {}))]
    # The call with the retired token is said, by method and peer, never by the token it carried.
    [stale] = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "admin_unauthenticated"]
    assert stale["method"] == "GetStatus" and stale["peer"].startswith("ipv") and "first-token" not in repr(stale)


def test_no_token_anywhere_refuses_to_start_the_admin_port(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("RLPIPE_ADMIN_TOKEN", raising=False)
    cfg = run_config(tmp_path, tiny_model, admin={"port": 0})
    servicer = AdminServicer(control=None, status=StatusOnly(), live=None, recovery=None)

    with pytest.raises(ValueError, match="no admin token"):
        asyncio.run(start_admin_server(cfg, servicer))


@pytest.mark.unit
def test_a_token_file_replaced_by_one_of_the_same_size_and_time_is_read_again(tmp_path):
    # An atomic rotation (write a new file, rename it over the old) can keep the size and, within a clock tick or
    # with its time copied, the modification time: the file is another one all the same.
    path = tmp_path / "admin.token"
    path.write_text("first-token-aaaa\n")
    token = AdminToken(path=path)
    assert token.current() == "first-token-aaaa"
    replacement = tmp_path / "admin.token.new"
    replacement.write_text("other-token-bbbb\n")
    stat = path.stat()
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, path)
    assert token.current() == "other-token-bbbb"
