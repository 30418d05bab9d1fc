"""The trainer role's process: rank 0 takes the run's lease, loads the learner, starts weight sync and the admin
API, wires the ``Trainer`` loop (services/trainer/service.py) and ends it in order; the other torchrun ranks only
follow rank 0's commands (``follower_main``).

Refusals at start (another run's or an unreadable store, a checkpoint that does not fit, a lineage it cannot read,
a broker that lost the run's state) exit 2, which the launcher does not restart; losing the lease ends the process
at once. A store out of reach at start is waited for (``checkpoint.resume_wait_s``) before it is refused.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import yaml

from services.common.cancel import cancel_until_done
from services.common.config import BuildInfo, RunConfig, redacted_dump
from services.common.model.preprocess import Preprocessor
from services.common.observe.events import Event
from services.common.observe.logs import Stopwatch, log_event
from services.common.observe.network import watch_network_bytes
from services.common.observe.telemetry import current_telemetry
from services.common.observe.trackers import open_trackers
from services.common.pb import admin_pb2_grpc, weights_pb2_grpc
from services.common.service import (
    EXIT_REFUSED,
    announce_ready,
    exit_when_stalled,
    start_grpc_server,
    watch_progress,
)
from services.common.transport import weight_sync_tls
from services.common.transport.bus import Bus
from services.common.transport.lease_bucket import open_bucket as open_lease_bucket
from services.common.transport.live_config import LiveConfig
from services.common.transport.presence import Presence
from services.common.transport.storage import open_store
from services.common.transport.streams import BrokerStateLost
from services.common.transport.weightsync import auth as weight_sync_auth
from services.common.transport.weightsync.server import WeightSyncServer
from services.trainer.admin import AdminServicer, AdminToken, BearerToken, SourceAllowlist
from services.trainer.checkpointing.adopter import ResumeRefused, wait_for_store
from services.trainer.checkpointing.lineage import LineageError
from services.trainer.checkpointing.manifest import UnknownCheckpointFormat
from services.trainer.checkpointing.resume import StoreUnreadable
from services.trainer.checkpointing.state import CheckpointMismatch
from services.trainer.checkpointing.step_reader import ForeignCheckpoints
from services.trainer.checkpointing.step_store import FencedOut
from services.trainer.checkpointing.store import CheckpointStore
from services.trainer.learning.distributed import Mesh
from services.trainer.learning.follower import follow
from services.trainer.learning.learner import Learner
from services.trainer.lease import Lease, LeaseLost
from services.trainer.served_versions import ServedVersions
from services.trainer.service import Trainer

LEASE_LOST_CANCEL_AGAIN_S = 5.0

log = logging.getLogger(__name__)
ADMIN_GRACE_S = 10.0  # an admin call in progress at shutdown (the operator's Stop) may finish within it


def record_run_start(cfg: RunConfig, build: BuildInfo, config_version: int) -> None:
    """What this trainer runs with, beside the run's metrics: the effective config (secrets redacted) and the build."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "effective-config.yaml").write_text(
        f"# config version {config_version}, rlpipe {build.version} ({build.revision})\n"
        + yaml.safe_dump(redacted_dump(cfg), sort_keys=False)
    )
    log_event(
        log,
        Event.BUILD,
        version=build.version,
        revision=build.revision,
        config_version=config_version,
        environment=cfg.environment,
    )


async def take_lease(cfg: RunConfig, bus: Bus) -> Lease:
    """The run's lease, at an epoch above the fence already in the checkpoint store (so epochs keep growing when
    the broker lost the lease bucket); StartRefused naming the holder while another trainer holds it."""
    fence = CheckpointStore(open_store(cfg.checkpoint_url, cfg.checkpoint), cfg.run_id, cfg.checkpoint.keep_last)

    def read_floor() -> int:
        try:
            return fence.stored_fence()
        except Exception as error:  # the store's many failure types: an outage is waited out, as a resume's is
            raise StoreUnreadable(f"cannot read the lease fence: {error!r}"[:500]) from error

    where = fence.location()
    floor = await wait_for_store(read_floor, cfg.checkpoint, where, f"not starting on {where}")
    kv = await open_lease_bucket(bus.js, cfg.run_id, cfg.nats.storage, cfg.nats.stream_replicas)
    lease = Lease(kv, cfg.run_id, cfg.trainer.lease_ttl_s, reaped_holder=cfg.trainer.takeover_from)
    epoch = await lease.acquire(floor)
    log_event(log, Event.LEASE_ACQUIRED, epoch=epoch, holder=lease.holder, ttl_s=lease.ttl_s)
    return lease


async def start_admin_server(cfg: RunConfig, servicer: AdminServicer) -> tuple[Any, str]:
    """Admin on its own port (the one operators reach), open to ``admin.allowed_sources`` only, behind the bearer
    tokens (the admin token, and the read token for the calls that read), TLS when configured."""
    credentials = None
    admin = cfg.admin
    if admin.tls_cert is not None and admin.tls_key is not None:  # both or neither (AdminConfig checks)
        credentials = grpc.ssl_server_credentials([(admin.tls_key.read_bytes(), admin.tls_cert.read_bytes())])

    def register(server: Any) -> list[str]:
        admin_pb2_grpc.add_AdminServicer_to_server(servicer, server)
        return ["rlpipe.v1.Admin"]

    return await start_grpc_server(
        cfg,
        cfg.admin.port,
        register,
        interceptors=[
            SourceAllowlist(cfg.admin.allowed_sources),
            BearerToken(AdminToken.from_config(cfg), AdminToken.read_only_from_config(cfg)),
        ],
        credentials=credentials,
    )


async def main(cfg: RunConfig, stop: asyncio.Event) -> None:
    """Rank 0's trainer (the only one when not under torchrun); ``follower_main`` runs the other ranks."""
    mesh = Mesh.from_env()
    try:
        await lead(cfg, stop, mesh)
    finally:
        mesh.close()  # followers stop with it, also when it exits refusing to start


def follower_main(mesh: Mesh, cfg: RunConfig) -> None:
    """A trainer rank other than 0: it holds shards and runs rank 0's commands; rank 0 alone talks to NATS,
    the admin API and weight sync, so nothing else starts here."""
    learner = Learner(cfg, mesh)
    log_event(log, Event.FOLLOWER_READY, rank=mesh.rank, world=mesh.world)
    try:
        follow(mesh, learner)
    finally:
        mesh.close()
    log_event(log, Event.FOLLOWER_STOPPED, rank=mesh.rank)


async def lead(cfg: RunConfig, stop: asyncio.Event, mesh: Mesh) -> None:
    """Rank 0 holding the run's lease from before it writes anything until it exits; losing it ends the process at
    once, saving nothing: exit 2 when another trainer took over (never restarted), 1 when the lease is gone from
    its bucket (a restart takes it anew). A lease that merely ran out is taken back by the keeper."""
    started = Stopwatch()
    bus = await Bus(cfg, "trainer").connect()
    lost: list[LeaseLost] = []
    try:
        lease = await take_lease(cfg, bus)  # before anything of the run is written: one trainer per run
        running = asyncio.current_task()
        if running is None:
            raise RuntimeError("the trainer's lead runs as an asyncio task")

        async def on_lease_lost(error: LeaseLost) -> None:
            lost.append(error)
            log_event(
                log,
                Event.LEASE_LOST,
                level=logging.CRITICAL,
                alert=True,
                epoch=lease.epoch,
                taken_over=error.taken_over,
                error=str(error),
            )
            # Repeated until it ends (this keeper is cancelled by then): one cancellation can be dropped
            # (services/common/cancel.py). Spaced past the servers' graceful stops, which a repeat would cut short.
            await cancel_until_done(running, every_s=LEASE_LOST_CANCEL_AGAIN_S)

        # Renewed from now: loading the model and a resume that waits for its store can outlast a TTL.
        keeper = asyncio.create_task(lease.keep(on_lease_lost))
        try:
            await lead_holding(cfg, stop, mesh, bus, lease, started)
        except asyncio.CancelledError:
            raise_if_lost(lost)
            raise
        finally:
            try:
                # Ended before the release: a renewal it finished after a dropped cancellation would move the
                # lease's revision under the release, which would then find the lease "taken" and leave it to run
                # out. Such a renewal may also find the lease lost and cancel this task on its way out.
                await cancel_until_done(keeper)
            except asyncio.CancelledError:
                raise_if_lost(lost)
                raise
            if not lost:
                await lease.release()
    finally:
        await bus.close()


def raise_if_lost(lost: list[LeaseLost]) -> None:
    """The trainer's exit once its lease is lost: 2 when another trainer took over (a supervisor must not restart
    it), 1 when the lease is gone (a restart takes it again)."""
    if lost:
        raise SystemExit(EXIT_REFUSED if lost[0].taken_over else 1) from lost[0]


async def lead_holding(
    cfg: RunConfig, stop: asyncio.Event, mesh: Mesh, bus: Bus, lease: Lease, started: Stopwatch
) -> None:
    """The trainer's life once it holds the lease: start-up, the loop, and an orderly end."""
    live = await LiveConfig(cfg, bus.js).start()
    learner = await asyncio.to_thread(Learner, cfg, mesh)
    model_s = started()
    initial = await asyncio.to_thread(learner.snapshot, 0, 0)  # a copy of the model, off the loop that renews the lease
    weights = WeightSyncServer(initial, fanout=cfg.rollout.relay_fanout)
    watch_network_bytes("trainer", "weight_sync", "out", lambda: weights.sent_bytes)

    def register(server: Any) -> list[str]:
        weights_pb2_grpc.add_WeightSyncServicer_to_server(weights, server)
        return ["rlpipe.v1.WeightSync"]

    server, address = await start_grpc_server(
        cfg,
        cfg.service.trainer_grpc_port,
        register,
        interceptors=weight_sync_auth.server_interceptors(cfg.environment),
        credentials=weight_sync_tls.server_credentials(cfg.weight_sync, cfg.rollout, weight_sync_tls.TRAINER),
    )
    # Off the loop, which renews the lease meanwhile: MLflow's first open creates its database (16 s seen under load).
    trackers = await asyncio.to_thread(open_trackers, cfg)
    preprocessor = Preprocessor(learner.tokenizer, cfg.model.folder, cfg.data.tokenize_workers)
    await asyncio.to_thread(preprocessor.start)  # seconds with workers: a fork server, a tokenizer each
    trainer = Trainer(cfg, bus, learner, weights, live, trackers, preprocessor, ServedVersions(lease.kv))
    try:
        trainer.checkpoints.guard = lease.check
        # The fence is the trainer's first write to the store, made once the start has found there what it expects
        # (a resume its checkpoints, a fresh start no other run's): from then a predecessor of a lower epoch writes
        # nothing there, and a store found without the run's checkpoints is never written to.
        await trainer.prepare(claim=lambda: trainer.checkpoints.claim_fence(lease.epoch, lease.holder))
    except (
        FencedOut,
        ForeignCheckpoints,
        ResumeRefused,
        UnknownCheckpointFormat,
        CheckpointMismatch,
        LineageError,
    ) as error:
        # Exit 2, refused at start like a bad config: a supervisor that restarted it with resume on would
        # resume the other run's steps, wait out the same unreadable store again, or meet the same checkpoint
        # or the same unreadable lineage.jsonl line.
        log_event(log, Event.START_REFUSED, level=logging.ERROR, alert=True, error=str(error))
        raise SystemExit(EXIT_REFUSED) from error
    record_run_start(cfg, trainer.build, live.version)
    servicer = AdminServicer(trainer.control, trainer.status, live, trainer.recovery)
    admin_server, admin_address = await start_admin_server(cfg, servicer)
    trainer.presence = await Presence(bus.js, cfg, "trainer", live).start(
        grpc=address, admin=admin_address, metrics_url=current_telemetry().metrics_url
    )
    watchdog = asyncio.create_task(
        watch_progress(trainer.heartbeat, [server, admin_server], trainer.presence, lambda: trainer.time_spent)
    )
    await announce_ready(
        trainer.presence,
        grpc=address,
        admin=admin_address,
        metrics_url=current_telemetry().metrics_url,
        model=str(cfg.model.path),
        model_load_s=model_s,
        startup_s=started(),
    )
    orderly = False
    try:
        try:
            # A loop stalled past its bound plus service.exit_when_stalled_s ends the process, to be restarted.
            with exit_when_stalled(trainer.heartbeat, cfg.service.exit_when_stalled_s):
                await trainer.run(stop)
        except BrokerStateLost as error:
            # Going on would skip groups or wait forever; the operator decides (restore the broker's volume,
            # or start the run again from its checkpoints under a new run id).
            log_event(
                log, Event.BROKER_STATE_LOST, level=logging.CRITICAL, alert=True, stream=error.stream, error=str(error)
            )
            raise SystemExit(EXIT_REFUSED) from error
        progress = trainer.progress
        if progress.saved_step < progress.step:
            # Ending now would lose applied steps without a trace in the exit code; a restart re-does them.
            log_event(
                log,
                Event.ENDED_UNSAVED,
                level=logging.ERROR,
                alert=True,
                step=progress.step,
                saved_step=progress.saved_step,
            )
            raise SystemExit(1)
        orderly = True
    finally:
        watchdog.cancel()
        # First, while presence and the store still answer: the Stop call that ended the run is still composing
        # its reply (a status that reads presence and lists the store, seconds under load). The grace is how long
        # a call in progress may finish; new calls are refused at once.
        await admin_server.stop(grace=ADMIN_GRACE_S)
        trainer.responder.metrics.close()  # the trackers' last rows flushed (a W&B run finished)
        await trainer.presence.stop(orderly)
        await server.stop(grace=1)
