"""``python -m services.cli.healthcheck HOST:PORT [--timeout S] [--service NAME]``: one gRPC health check.

Exit 0 when the server answers SERVING, 1 otherwise with a one-line reason on stderr.
Container health checks run it every few seconds, so it imports only grpc (no torch,
no config) and always finishes within the timeout.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, timeout: float = 3.0, service: str = "") -> str | None:
    """None when ``address`` reports SERVING for ``service`` ("" = the whole server), else why not."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as error:
            detail = (error.details() or "").splitlines()[0] if error.details() else ""
            return f"{address}: {error.code().name}{': ' + detail if detail else ''}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.cli.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT of a service's gRPC server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--service", default="", help="a registered service name; empty checks the whole server")
    args = parser.parse_args(argv)
    reason = check(args.address, args.timeout, args.service)
    if reason is None:
        return 0
    print(f"unhealthy: {reason}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
