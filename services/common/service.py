"""What every service process shares: argument parsing, config, logging, signals, gRPC health."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.bus import Stage
from services.common.config import ConfigError, RunConfig, load_config
from services.common.logs import log_event, setup_logging

log = logging.getLogger(__name__)

ServiceMain = Callable[[RunConfig, asyncio.Event], Awaitable[None]]


async def start_grpc_server(
    cfg: RunConfig, port: int, register: Callable[[grpc.aio.Server], list[str]] | None = None
) -> tuple[grpc.aio.Server, str]:
    """A gRPC server with health and reflection, plus whatever ``register`` adds (it returns service names)."""
    server = grpc.aio.server()
    names = register(server) if register else []
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names.append(health.SERVICE_NAME)
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{cfg.service.host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {cfg.service.host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"{cfg.service.host}:{bound}"


async def serve_stage(stage: Stage, stop: asyncio.Event, server: grpc.aio.Server) -> None:
    """Run a stage until ``stop``, then close its health server and NATS connection."""
    try:
        await stage.run(stop)
    finally:
        log_event(log, "draining", handled=stage.handled)
        await server.stop(grace=1)
        await stage.bus.close()


def run_service(role: str, service_main: ServiceMain) -> None:
    """Entry point of ``python -m services.<role> --config FILE``."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{role}")
    parser.add_argument("--config", required=True, help="run config YAML (RLPIPE_* env vars override it)")
    args = parser.parse_args()
    try:
        cfg = load_config(args.config)
    except ConfigError as error:
        print(f"{role}: {error}", file=sys.stderr)
        sys.exit(2)
    setup_logging(role, cfg.run_id, cfg.service.log_level)

    import torch

    torch.set_num_threads(cfg.service.torch_threads)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await service_main(cfg, stop)

    try:
        asyncio.run(serve())
    except Exception:
        log.exception("crashed", extra={"fields": {}})
        sys.exit(1)
    log_event(log, "stopped")
