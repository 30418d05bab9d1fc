"""The admin token, the read-only admin token when one is set, and the weight-sync token are set (or generated) and
can go into a request's metadata; never quoted."""

from __future__ import annotations

from services.common.config import (
    AdminCredentials,
    RunConfig,
    TokenError,
    WeightSyncCredentials,
    read_token_file,
    token_problem,
)
from services.common.startup_checks.rows import CheckResult


def check_admin_token(cfg: RunConfig, launcher_generates: bool) -> CheckResult:
    """``launcher_generates``: started by ``rlpipe run``, which makes a token when none is set. A token that
    cannot go into a request's metadata (a line break, non-ASCII) fails, named by where it came from, never
    quoted."""
    if token := AdminCredentials().token:
        problem = token_problem(token)
        if problem is not None:
            return CheckResult("admin token", "fail", f"RLPIPE_ADMIN_TOKEN {problem}")
        return CheckResult("admin token", "ok", "set by RLPIPE_ADMIN_TOKEN")
    token_file = cfg.admin.token_file
    if token_file is None:
        missing = "neither RLPIPE_ADMIN_TOKEN nor admin.token_file is set"
    else:
        try:
            read_token_file(token_file, "admin.token_file")
            return CheckResult("admin token", "ok", f"read from admin.token_file {token_file}")
        except TokenError as error:
            if not error.empty:
                return CheckResult("admin token", "fail", str(error))
        missing = f"admin.token_file {token_file} is empty"
    if not launcher_generates:
        return CheckResult("admin token", "fail", f"{missing}: the trainer does not start without one")
    if cfg.environment == "prod":
        return CheckResult(
            "admin token", "fail", f"{missing}: a prod deployment must set its own, not rely on a generated one"
        )
    return CheckResult("admin token", "warn", f"{missing}: rlpipe run generates one into {cfg.run_dir / 'admin.token'}")


def check_admin_read_token(cfg: RunConfig) -> list[CheckResult]:
    """The read-only admin token, when one is set (none: no row, and no read-only access): it can go into a call's
    metadata, named by where it came from, never quoted. One equal to the admin token never gets here: the config
    refuses it at load."""
    if token := AdminCredentials().read_token:
        problem = token_problem(token)
        if problem is not None:
            return [CheckResult("admin read token", "fail", f"RLPIPE_ADMIN_READ_TOKEN {problem}")]
        return [CheckResult("admin read token", "ok", "set by RLPIPE_ADMIN_READ_TOKEN: the calls that read")]
    token_file = cfg.admin.read_token_file
    if token_file is None:
        return []
    try:
        read_token_file(token_file, "admin.read_token_file")
    except TokenError as error:  # empty too: the trainer would not start with a read token file holding none
        return [CheckResult("admin read token", "fail", str(error))]
    return [CheckResult("admin read token", "ok", f"read from admin.read_token_file {token_file}: the calls that read")]


def check_weight_sync_token() -> CheckResult:
    """RLPIPE_WEIGHTSYNC_TOKEN, when set, can go into a call's metadata (gRPC would refuse every call otherwise)."""
    token = WeightSyncCredentials().token
    problem = token_problem(token) if token else None
    if problem is not None:
        return CheckResult("weight-sync token", "fail", f"RLPIPE_WEIGHTSYNC_TOKEN {problem}")
    return CheckResult("weight-sync token", "ok", "set" if token else "not set (rlpipe run generates one)")
