"""The credentials ``rlpipe run`` makes for one start of a run, and which role is given which.

Each start makes them afresh: a NATS key per role (an earlier start's key opens nothing), the admin token and the
read-only token (RLPIPE_ADMIN_TOKEN / RLPIPE_ADMIN_READ_TOKEN if set, else fresh ones) kept owner-only in the run
directory for the CLI, and the weight-sync token (RLPIPE_WEIGHTSYNC_TOKEN if set, else a fresh one). A role is
given only what it needs (``role_env``); no service inherits a token from the launching shell (``inherited_env``).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from services.common.config import AdminCredentials, WeightSyncCredentials
from services.common.transport.nats_auth import RoleKey, write_run_credentials

# Credentials handed to the roles that need them (role_env), never to every child through the launcher's own shell.
ROLE_TOKENS = ("RLPIPE_ADMIN_TOKEN", "RLPIPE_ADMIN_READ_TOKEN", "RLPIPE_WEIGHTSYNC_TOKEN")


def inherited_env() -> dict[str, str]:
    """This shell's environment without the tokens only some roles are given (RunCredentials.role_env)."""
    return {name: value for name, value in os.environ.items() if name not in ROLE_TOKENS}


@dataclass
class RunCredentials:
    """One start's credentials, in ``run_dir``."""

    run_dir: Path
    nats_keys: dict[str, RoleKey] = field(default_factory=dict)
    weight_sync_token: str = ""

    @classmethod
    def issue(cls, run_dir: Path) -> RunCredentials:
        """Fresh NATS keys, the admin and read token files, and this start's weight-sync token."""
        issued = cls(
            run_dir.resolve(),
            nats_keys=write_run_credentials(run_dir.resolve() / "nats-auth"),
            # The trainer and the rollouts start together, so one token for this start serves both ends.
            weight_sync_token=WeightSyncCredentials().token or secrets.token_urlsafe(24),
        )
        issued.write_admin_tokens()
        return issued

    @property
    def token_file(self) -> Path:
        return self.run_dir.resolve() / "admin.token"

    @property
    def read_token_file(self) -> Path:
        return self.run_dir.resolve() / "admin-read.token"

    def write_admin_tokens(self) -> None:
        """The admin token (RLPIPE_ADMIN_TOKEN if set, else a fresh one) and the read-only token
        (RLPIPE_ADMIN_READ_TOKEN if set, else a fresh one), each kept owner-only in the run directory for the CLI
        (`rlpipe --read-only` uses the second)."""
        credentials = AdminCredentials()
        for path, token in (
            (self.token_file, credentials.token or secrets.token_urlsafe(24)),
            (self.read_token_file, credentials.read_token or secrets.token_urlsafe(24)),
        ):
            path.touch(mode=0o600)
            # touch's mode applies only to a new file: one kept from an earlier start (--resume) may be readable by all.
            path.chmod(0o600)
            path.write_text(token + "\n")

    def role_env(self, role: str) -> dict[str, str]:
        """What only ``role`` is given: its own NATS key, the admin and read tokens for the trainer alone (as files
        it re-reads, so that rewriting runs/<run>/admin.token or admin-read.token rotates it), and the weight-sync
        token for the trainer and the rollouts, the two ends of WeightSync."""
        env = {"RLPIPE_NATS__NKEY_SEED_FILE": str(self.nats_keys[role].seed_file)}
        if role == "trainer":
            env["RLPIPE_ADMIN__TOKEN_FILE"] = str(self.token_file)
            env["RLPIPE_ADMIN__READ_TOKEN_FILE"] = str(self.read_token_file)
        if role in ("trainer", "rollout"):
            env["RLPIPE_WEIGHTSYNC_TOKEN"] = self.weight_sync_token
        return env
