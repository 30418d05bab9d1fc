"""``rlpipe doctor``'s weight-sync rows: is the run's token there where it is required, and does a trainer already
serving at ``service.trainer_host``:``trainer_grpc_port`` refuse a call without it (and take the one given)?

The trainer's WeightSync port hands the policy's weights to any caller it admits, and a rollout's relay port the
same (services/common/transport/weightsync/auth.py): an open port is a leak, refused at start in prod.
"""

from __future__ import annotations

import grpc

from services.common.config import RunConfig, WeightSyncCredentials, token_problem
from services.common.pb import weights_pb2, weights_pb2_grpc
from services.common.startup_checks.rows import CheckResult
from services.common.transport import weight_sync_tls
from services.common.transport.weightsync.auth import token_metadata

NAME = "weight-sync token"
# A doctor run must not hang on a trainer that does not answer.
PROBE_TIMEOUT_S = 3.0


def weight_sync_rows(cfg: RunConfig, embedded: bool) -> list[CheckResult]:
    """``embedded``: the config is for ``rlpipe run``, which makes a token at every start and binds the trainer's
    port itself, so there is neither a token to require nor a port to probe."""
    token = WeightSyncCredentials().token
    rows = [token_row(cfg, token, embedded)]
    if not embedded and cfg.service.trainer_grpc_port:
        rows.append(port_row(cfg, token))
    return rows


def token_row(cfg: RunConfig, token: str, embedded: bool) -> CheckResult:
    if token:
        problem = token_problem(token)  # gRPC would refuse every call's metadata; named, never quoted
        if problem is not None:
            return CheckResult(NAME, "fail", f"RLPIPE_WEIGHTSYNC_TOKEN {problem}")
        return CheckResult(NAME, "ok", "set by RLPIPE_WEIGHTSYNC_TOKEN")
    if embedded:
        return CheckResult(NAME, "ok", "rlpipe run makes one at every start, for the trainer and the rollouts alone")
    if cfg.environment == "prod":
        missing = "RLPIPE_WEIGHTSYNC_TOKEN is not set: a prod trainer refuses to start without one"
        return CheckResult(NAME, "fail", missing)
    return CheckResult(
        NAME, "warn", "RLPIPE_WEIGHTSYNC_TOKEN is not set: the trainer's port serves the weights to any caller"
    )


def _version_call(cfg: RunConfig, token: str) -> grpc.StatusCode:
    """The status of one GetVersion to the trainer, with ``token`` ("" = none), over TLS where the run has it."""
    credentials = weight_sync_tls.channel_credentials(cfg.weight_sync)
    address = cfg.trainer_address
    channel = (
        grpc.secure_channel(address, credentials, options=weight_sync_tls.name_override(cfg.service))
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        try:
            weights_pb2_grpc.WeightSyncStub(channel).GetVersion(
                weights_pb2.GetVersionRequest(), timeout=PROBE_TIMEOUT_S, metadata=token_metadata(token)
            )
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def port_row(cfg: RunConfig, token: str) -> CheckResult:
    """A trainer already serving must refuse a caller without the token, and admit this one's."""
    address = cfg.trainer_address
    without = _version_call(cfg, "")
    if without in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CheckResult(NAME, "skip", f"no trainer answers at {address} ({without.name}): nothing to probe yet")
    if without == grpc.StatusCode.OK:
        status = "fail" if token or cfg.environment == "prod" else "warn"
        return CheckResult(NAME, status, f"the trainer at {address} serves weights to a caller without the token")
    if without != grpc.StatusCode.UNAUTHENTICATED:
        return CheckResult(NAME, "fail", f"the trainer at {address} answered {without.name} to a call without a token")
    if not token:
        return CheckResult(NAME, "ok", f"the trainer at {address} refuses a call without the token")
    given = _version_call(cfg, token)
    if given != grpc.StatusCode.OK:
        return CheckResult(
            NAME,
            "fail",
            f"the trainer at {address} refuses RLPIPE_WEIGHTSYNC_TOKEN ({given.name}): not the run's token",
        )
    return CheckResult(NAME, "ok", f"the trainer at {address} refuses a call without the token and takes this one")
