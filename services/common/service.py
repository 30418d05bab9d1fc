"""What every service process shares: argument parsing, config, logging, signals, gRPC health."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import JsonValue

from services.common.cancel import cancel_until_done
from services.common.config import ConfigError, Role, RunConfig, load_config
from services.common.model.gpu_share import apply_gpu_share
from services.common.observe.events import Event
from services.common.observe.instruments import watch_gpu_memory, watch_gpus
from services.common.observe.logs import bind_log_fields, log_event, setup_logging
from services.common.observe.network import export_link_capacity
from services.common.observe.telemetry import current_telemetry, start_telemetry
from services.common.observe.timeshare import StageActivity
from services.common.observe.writer import close_all as close_writers
from services.common.refusal import StartRefused
from services.common.startup_checks.roles import startup_checks
from services.common.startup_checks.rows import StartupCheckError
from services.common.transport.breaker import Refusal
from services.common.transport.bus import Bus
from services.common.transport.live_config import LiveConfig, stored_config
from services.common.transport.model_source import ModelFetchFailed, resolve_model
from services.common.transport.presence import Presence, ServiceEntry, instance_name
from services.common.transport.stage import Stage

log = logging.getLogger(__name__)
# How often a stage's watchdog compares its loop's progress with the stall bound and updates health and presence.
WATCHDOG_S = 1.0
# Each server's health servicer, for the watchdog to flip; weak, so a stopped server is not kept alive.
# (typeshed's grpc_health stub lacks the module's aio, which it has had since grpcio 1.38)
_health_servicers: weakref.WeakKeyDictionary[grpc.aio.Server, health.aio.HealthServicer] = weakref.WeakKeyDictionary()  # pyright: ignore[reportAttributeAccessIssue]

ServiceMain = Callable[[RunConfig, asyncio.Event], Awaitable[None]]
# A service that cannot run as configured (bad config, failed start-up check, a checkpoint store holding another
# run, a broker that lost this run's messages) exits with this code: restarting it would fail the same way, or
# worse (a trainer restarted with resume on would adopt the other run's steps), so supervisors must not.
EXIT_REFUSED = 2
# A service whose loop stayed stalled past service.exit_when_stalled_s exits with this code, for its supervisor to
# restart it (Docker's restart policy acts on an exit, never on a failing health check).
EXIT_STALLED = 3
# A fixed port (a restarted trainer keeps its admin port, so the CLI's run.json stays right) can be held for a
# moment after its last owner died: an outgoing connection of another process may have drawn it from the same
# ephemeral range. Binding is tried again for this long before the service gives up.
BIND_WAIT_S = 20.0
# The roles that load model.path (the reward's own model is reward.model's): each fetches it if need be and checks
# its hash at start.
MODEL_ROLES = ("trainer", "rollout", "reference")


async def start_grpc_server(
    cfg: RunConfig,
    port: int,
    register: Callable[[grpc.aio.Server], list[str]] | None = None,
    interceptors: list[grpc.aio.ServerInterceptor] | None = None,
    credentials: grpc.ServerCredentials | None = None,
    bind_wait_s: float = BIND_WAIT_S,
) -> tuple[grpc.aio.Server, str]:
    """A gRPC server with health and reflection, plus whatever ``register`` adds (it returns service names);
    TLS with ``credentials``. A fixed ``port`` that is taken is tried again for ``bind_wait_s``."""
    where = f"{cfg.service.host}:{port}"
    deadline, delay = time.monotonic() + bind_wait_s, 0.25
    while True:
        # No SO_REUSEPORT: a port another process holds must fail the bind, not be shared with it silently.
        server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        try:
            bound = server.add_secure_port(where, credentials) if credentials else server.add_insecure_port(where)
        except RuntimeError:  # grpcio raises this where older releases returned 0
            bound = 0
        if bound:
            break
        if port == 0 or time.monotonic() >= deadline:
            raise OSError(f"cannot bind gRPC port {where}: in use or not allowed")
        log_event(log, Event.PORT_BUSY, level=logging.WARNING, address=where, retry_in_s=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)
    names = register(server) if register else []
    health_servicer = health.aio.HealthServicer()  # pyright: ignore[reportAttributeAccessIssue]  (see _health_servicers)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names.append(health.SERVICE_NAME)
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    _health_servicers[server] = health_servicer
    return server, f"{cfg.service.host}:{bound}"


async def join_run(cfg: RunConfig, bus: Bus, role: str, **endpoints: str) -> tuple[LiveConfig, Presence]:
    """The run's live config (newest stored version applied) and this replica's presence entry."""
    live = await LiveConfig(cfg, bus.js, creates_bucket=bus.creates_streams).start()
    presence = await Presence(bus.js, cfg, role, live).start(metrics_url=current_telemetry().metrics_url, **endpoints)
    return live, presence


async def announce_ready(presence: Presence, **facts: JsonValue) -> None:
    """The replica is ready: its ``ready`` event in the log, and the same facts in its presence entry at once
    (under ``startup``, with ``ready_at``, the wall time; endpoints and versions in their own fields too), which is
    where the launcher learns it."""
    torch = sys.modules.get("torch")
    if torch is not None:  # the threads it computes with (service.torch_threads / role_torch_threads)
        facts = {**facts, "torch_threads": torch.get_num_threads()}
    log_event(log, Event.READY, logging.INFO, **facts)
    fields = {name: value for name, value in facts.items() if name in ServiceEntry.model_fields}
    await presence.announce(**fields, startup={**facts, "ready_at": round(time.time(), 3)})


class LoopProgress(Protocol):
    """A service loop's progress as the watchdog reads it: a ``Stage``, the trainer's ``LoopHeartbeat``."""

    last_progress: float  # wall time the loop last moved

    def stalled_for(self, now: float) -> float:
        """Seconds the loop has gone without progress beyond its bound (0 while it is moving)."""
        ...


async def watch_progress(
    loop: LoopProgress,
    servers: list[grpc.aio.Server],
    presence: Presence,
    time_spent: Callable[[], Mapping[StageActivity, float]] | None = None,
    refusal: Callable[[], Refusal | None] | None = None,
) -> None:
    """For ever: the loop's progress (and ``time_spent()``, its seconds per busy/idle/blocked) into its presence
    entry, and the gRPC health of ``servers`` NOT_SERVING while the loop is stuck past its bound (SERVING again
    once it moves), so a liveness probe restarts the service. ``refusal()``, a refusing dependency holding the
    loop, is written at once when it changes: the trainer alerts on it in the run's events."""
    health_servicers = [_health_servicers[server] for server in servers]
    stuck = False
    while True:
        presence.update(progress_time=loop.last_progress)
        if time_spent is not None:
            presence.update(time_s={str(activity): round(seconds, 3) for activity, seconds in time_spent().items()})
        if refusal is not None and (held := refusal()) != presence.entry.refused:
            await presence.announce(refused=held)
        stalled_s = loop.stalled_for(time.time())
        if (stalled_s > 0) != stuck:
            stuck = not stuck
            status = health_pb2.HealthCheckResponse.NOT_SERVING if stuck else health_pb2.HealthCheckResponse.SERVING
            for health_servicer in health_servicers:
                await health_servicer.set("", status)
            if stuck:
                log_event(
                    log,
                    Event.LOOP_STALLED,
                    level=logging.ERROR,
                    alert=True,
                    no_progress_s=round(time.time() - loop.last_progress, 1),
                    health="NOT_SERVING",
                )
            else:
                log_event(log, Event.LOOP_PROGRESSING, health="SERVING")
        await asyncio.sleep(WATCHDOG_S)


@contextmanager
def exit_when_stalled(loop: LoopProgress, after_s: float, check_every_s: float = WATCHDOG_S) -> Iterator[None]:
    """While inside: a thread that ends the process with ``EXIT_STALLED`` once ``loop`` has been stalled (past its
    own bound) for more than ``after_s`` seconds; 0 = no thread. A thread, not a task, because the loop that stalls
    may be the event loop itself (a compute that blocks it), which would hold a task back too. Nothing is drained
    on the way out: the loop that would drain is the one stuck, and the messages it holds are redelivered."""
    if after_s <= 0:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(check_every_s):
            now = time.time()
            if loop.stalled_for(now) > after_s:
                log_event(
                    log,
                    Event.STALLED_EXIT,
                    level=logging.CRITICAL,
                    alert=True,
                    no_progress_s=round(now - loop.last_progress, 1),
                    exit_when_stalled_s=after_s,
                    exit_code=EXIT_STALLED,
                )
                logging.shutdown()  # the line above reaches its file and stderr before the process goes
                sys.stderr.flush()
                os._exit(EXIT_STALLED)

    thread = threading.Thread(target=watch, name="exit-when-stalled", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


async def serve_stage(stage: Stage, stop: asyncio.Event, server: grpc.aio.Server, presence: Presence) -> None:
    """Run a stage until ``stop``, then close its health server and NATS connection. A stage stalled for longer
    than ``service.exit_when_stalled_s`` ends the process (``exit_when_stalled``)."""
    watchdog = asyncio.create_task(
        watch_progress(stage, [server], presence, stage.time_share.seconds, lambda: stage.outage.refusal)
    )
    orderly = False
    try:
        with exit_when_stalled(stage, stage.bus.cfg.service.exit_when_stalled_s):
            await stage.run(stop)
        orderly = True
    finally:
        watchdog.cancel()
        log_event(log, Event.DRAINING, handled=stage.handled)
        await presence.stop(orderly)
        await server.stop(grace=1)
        await stage.bus.close()


def run_service(role: Role, service_main: ServiceMain) -> None:
    """Entry point of ``python -m services.<role> --config FILE``."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{role}")
    parser.add_argument("--config", required=True, help="run config YAML (RLPIPE_* env vars override it)")
    args = parser.parse_args()
    try:
        cfg = load_config(args.config)
    except ConfigError as error:
        print(f"{role}: {error}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    instance = instance_name(cfg.service, role)
    own = cfg.service
    # In a container the runtime keeps stderr; the file is what `rlpipe archive` copies into the run's archive.
    log_file = own.log_dir / f"{instance}.log" if own.log_dir else None
    setup_logging(role, cfg.run_id, own.log_level, log_file, own.log_max_mib * 2**20, own.log_keep)
    bind_log_fields(instance=instance)
    if role in MODEL_ROLES:
        try:
            cfg = resolve_model(cfg)
        except StartRefused as error:  # a model that is not the one pinned, or a source the config cannot reach
            log_event(log, Event.START_REFUSED, level=logging.ERROR, alert=True, error=str(error))
            print(f"{role}: {error}", file=sys.stderr)
            sys.exit(EXIT_REFUSED)
        except ModelFetchFailed:  # the source is unreachable for now: a restart may find it back
            log.exception(Event.CRASHED, extra={"fields": {}})
            sys.exit(1)
    try:
        startup_checks(cfg, role, resume=cfg.checkpoint.resume)
    except StartupCheckError as error:
        log_event(log, Event.STARTUP_CHECK_FAILED, level=logging.ERROR, error=str(error))
        print(f"{role}: {error}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    # Before the service's main, so its ready event can name the metrics endpoint and its first spans are kept.
    try:
        telemetry = start_telemetry(cfg, role, instance)
    except OSError as error:
        print(
            f"{role}: cannot serve metrics on {cfg.service.host}:{cfg.telemetry.metrics_port}: {error}", file=sys.stderr
        )
        sys.exit(2)
    if cfg.telemetry.link_mib_s:
        export_link_capacity(role, cfg.telemetry.link_mib_s * 2**20)
    # Every role's GPUs on its metrics endpoint, the trainer's as well as a rollout's engine or a reward model's.
    gpus = watch_gpus(role)
    watch_gpu_memory(role)
    if gpus is not None:
        log_event(log, Event.GPUS_WATCHED, gpus=[reading.uuid for reading in gpus.read()])

    # Every role that computes with torch has imported it by now; a rule-only reward replica has not, and importing
    # it only to cap its threads would cost that replica ~5 CPU seconds of start-up (the reward model caps its own).
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(cfg.service.threads_for(role))
    # Before the role's model loads: its allocations from the first on keep to its share of a GPU it shares.
    try:
        apply_gpu_share(cfg, role)
    except ConfigError as error:  # a share this GPU cannot honour: refused as a failed start-up check is
        log_event(log, Event.STARTUP_CHECK_FAILED, level=logging.ERROR, error=str(error))
        print(f"{role}: {error}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            # Restart-only changes stored through the admin take effect now, for every role alike.
            await service_main(await stored_config(cfg, role), stop)
        finally:
            # What a crash left running (a presence heartbeat, a bus restore) ends here: asyncio.run's own clean-up
            # cancels each leftover task once and waits for it, which one dropped cancellation would hang.
            await cancel_until_done(*(asyncio.all_tasks() - {asyncio.current_task()}))

    try:
        asyncio.run(serve())
    except StartRefused as error:
        # One event with the reason (the launcher prints it), and the exit code no supervisor restarts.
        log_event(log, Event.START_REFUSED, level=logging.ERROR, alert=True, error=str(error))
        sys.exit(EXIT_REFUSED)
    except Exception:
        log.exception(Event.CRASHED, extra={"fields": {}})  # the launcher reads the traceback (crash_loop.py)
        sys.exit(1)
    finally:
        close_writers()  # the metrics rows and tracker calls still queued are written: the process ends below
        telemetry.shutdown()  # sends the spans and metrics still queued
    log_event(log, Event.STOPPED)
    # Drained: the stage's work is acked or handed back, its connections closed, telemetry flushed. What is left is
    # the interpreter's teardown (joining library threads, finalizers of torch, vLLM and gRPC), which on a loaded
    # host has outlasted supervision.stop_grace_s after "stopped" was logged, turning a clean stop into a SIGKILL
    # the launcher counts as a failure. Nothing of the run's state depends on it, so the process ends here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
