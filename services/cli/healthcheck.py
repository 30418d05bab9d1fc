"""``python -m services.cli.healthcheck [HOST:PORT] [--config FILE --role ROLE] [--timeout S] [--service NAME]``:
one gRPC health check.

Exit 0 when the server answers SERVING, 1 otherwise with a one-line reason on stderr.
Container health checks run it every few seconds, so it imports only grpc (no torch) and always finishes within
the timeout. With ``--config`` and ``--role`` it reads the run's config as the service does (the file, then the
``RLPIPE_*`` environment): the port is the role's (127.0.0.1 unless HOST:PORT is given), and where the role's port
speaks TLS (``weight_sync.tls_*``: the trainer's, a relaying rollout's) the check does too, since a plaintext probe
of a TLS port only ever fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROLES = ("trainer", "rollout", "reward", "reference")


def check(
    address: str,
    timeout: float = 3.0,
    service: str = "",
    credentials: grpc.ChannelCredentials | None = None,
    options: tuple[tuple[str, str], ...] = (),
) -> str | None:
    """None when ``address`` reports SERVING for ``service`` ("" = the whole server), else why not; over TLS with
    ``credentials``."""
    channel = (
        grpc.secure_channel(address, credentials, options=options)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        try:
            # (typeshed's HealthStub lacks the Check its __init__ sets)
            reply = health_pb2_grpc.HealthStub(channel).Check(  # pyright: ignore[reportAttributeAccessIssue]
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as error:
            detail = (error.details() or "").splitlines()[0] if error.details() else ""
            return f"{address}: {error.code().name}{': ' + detail if detail else ''}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def check_role(config: Path, role: str, address: str = "", timeout: float = 3.0, service: str = "") -> str | None:
    """``check`` of ``role``'s own port as the run's config describes it (port and TLS)."""
    # Imported here: the plain HOST:PORT form stays as light as it always was.
    from services.common.config import ConfigError, load_config
    from services.common.transport import weight_sync_tls

    try:
        cfg = load_config(config)
    except ConfigError as error:
        return f"config {config}: {str(error).splitlines()[0]}"
    port = cfg.service.trainer_grpc_port if role == "trainer" else cfg.service.grpc_port
    credentials = weight_sync_tls.probe_credentials(cfg, role)
    options = weight_sync_tls.name_override(cfg) if credentials is not None else ()
    return check(address or f"127.0.0.1:{port}", timeout, service, credentials, options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.cli.healthcheck", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("address", nargs="?", default="", help="HOST:PORT of a service's gRPC server")
    parser.add_argument("--config", type=Path, help="the run's config file: port and TLS from it (with --role)")
    parser.add_argument("--role", choices=ROLES, help="whose port --config describes")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--service", default="", help="a registered service name; empty checks the whole server")
    args = parser.parse_args(argv)
    if (args.config is None) != (args.role is None):
        parser.error("--config and --role go together")
    if args.config is None and not args.address:
        parser.error("give HOST:PORT, or --config and --role")
    if args.config is not None:
        reason = check_role(args.config, args.role, args.address, args.timeout, args.service)
    else:
        reason = check(args.address, args.timeout, args.service)
    if reason is None:
        return 0
    print(f"unhealthy: {reason}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
