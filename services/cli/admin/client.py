"""Where the trainer's Admin service is (the options, else the newest local run) and how one call to it goes: its
deadline, its token, and the exit code a failure ends the command with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import grpc
import typer
from rich.console import Console

from services.common.config import AdminCredentials, RunsLocation
from services.common.pb import admin_pb2_grpc

REFUSED, USAGE, UNREACHABLE, UNAUTHENTICATED = 1, 2, 3, 4

_EXIT_OF = {
    grpc.StatusCode.UNAUTHENTICATED: UNAUTHENTICATED,
    grpc.StatusCode.UNAVAILABLE: UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: UNREACHABLE,
}

READ_DEADLINE_S = 10.0

SCALE_POLL_S = 1.0  # how often `rlpipe scale --wait` reads the status

# Commands the training loop runs between steps: they wait for the step in progress, and a checkpoint
# or rollback moves the whole model through the store. A deadline that expires first leaves the
# command undone (the trainer skips commands whose caller has gone), never done behind the caller's back.
LOOP_DEADLINE_S = 600.0

RUN_BY_THE_LOOP = {"Pause", "Resume", "Stop", "Checkpoint", "Rollback", "MarkStable"}


class Target:
    """Where and how to reach the Admin service, from the options or the newest local run."""

    def __init__(
        self,
        address: str,
        token: str,
        timeout: float,
        run_dir: Path | None,
        tls_ca: Path | None,
        runs_dir: Path | None = None,
        read_only: bool = False,
    ):
        self.runs_dir = runs_dir or RunsLocation().runs_dir
        self.run_dir = run_dir or newest_run_dir(self.runs_dir)
        self.given_address = address
        self.given_token = token
        self.timeout = timeout
        self.tls_ca = tls_ca
        self.read_only = read_only  # the read token instead of the admin token: the calls that read, and no other

    def _recorded(self, key: str) -> str:
        if self.run_dir is None or not (self.run_dir / "run.json").is_file():
            fail(
                USAGE,
                f"no --address given and no {self.runs_dir}/*/run.json found (start a run with `rlpipe run CONFIG`; "
                "a run elsewhere: --runs-dir or RLPIPE_RUNS_DIR, its config's runs_dir, or --run-dir)",
            )
        value = json.loads((self.run_dir / "run.json").read_text()).get(key)
        if not value:
            fail(USAGE, f"{self.run_dir / 'run.json'} has no {key!r} yet (is the trainer up?)")
        return value

    def _token_file(self, name: str) -> str:
        path = self.run_dir / name if self.run_dir else None
        return path.read_text().strip() if path and path.is_file() else ""

    def token(self) -> str:
        """--token, else the admin token (RLPIPE_ADMIN_TOKEN, the run's admin.token), or with --read-only the read
        token (RLPIPE_ADMIN_READ_TOKEN, the run's admin-read.token)."""
        if self.given_token:
            return self.given_token
        credentials = AdminCredentials()
        if self.read_only:
            return credentials.read_token or self._token_file("admin-read.token")
        return credentials.token or self._token_file("admin.token")

    def call(self, method: str, request: Any) -> Any:
        address = self.given_address or self._recorded("admin")
        token = self.token()
        channel = (
            grpc.secure_channel(address, grpc.ssl_channel_credentials(self.tls_ca.read_bytes()))
            if self.tls_ca
            else grpc.insecure_channel(address)
        )
        with channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            try:
                timeout = self.timeout or (LOOP_DEADLINE_S if method in RUN_BY_THE_LOOP else READ_DEADLINE_S)
                return getattr(stub, method)(request, timeout=timeout, metadata=[("authorization", f"Bearer {token}")])
            except grpc.RpcError as error:
                fail(_EXIT_OF.get(error.code(), REFUSED), f"{method}: {error.code().name}: {error.details()}")


def newest_run_dir(runs: Path) -> Path | None:
    found = sorted(runs.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def fail(code: int, message: str) -> NoReturn:
    # Unwrapped: a path or an address in the message must stay greppable at any terminal width.
    Console(stderr=True).print(f"[red]rlpipe:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def plain(message: Any) -> dict[str, Any]:
    """A message as plain JSON types, every field present (proto3's JSON mapping would quote 64-bit integers)."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        repeated = field.is_repeated
        if field.message_type is not None:
            out[field.name] = [plain(item) for item in value] if repeated else plain(value)
        else:
            out[field.name] = list(value) if repeated else value
    return out
