"""What the trainer reports about the run: services and their lag, the Admin ``Status`` reply, and the replicas a
refusing dependency holds.

Presence and consumer lag are read from JetStream at most every few seconds (``max_age_s``)
and cached, so status calls and the health checks between steps cost the broker little.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.errors import Error as NatsError

from services.common.config import BuildInfo
from services.common.observe.events import Event, Journal
from services.common.observe.instruments import DiskWatch, StageMetrics
from services.common.observe.logs import log_event
from services.common.pb import admin_pb2
from services.common.transport.breaker import Refusal
from services.common.transport.bus import Bus
from services.common.transport.live_config import bucket_name as config_bucket
from services.common.transport.presence import (
    RestartCounter,
    SeenService,
    gone_for,
    instance_name,
    presence_key,
    prune_presence,
    read_presence,
    role_gpu_memory,
    role_time_shares,
    roles_down,
    roles_stalled,
)
from services.common.transport.scale import read_scale
from services.common.transport.stage import stall_bound_s
from services.common.transport.streams import EXPERIENCE, WORK_QUEUES, stream_name
from services.trainer.alerts import AlertEvaluator, Firing
from services.trainer.checkpointing.manifest import CatalogEntry
from services.trainer.control import Control
from services.trainer.intake.ledger import GroupLedger
from services.trainer.progress import ConfigSource, Progress

log = logging.getLogger(__name__)
ROLE_STARTUP_GRACE_S = 300.0  # a role may take this long to register its first replica (image pulls, engine loads)
CHECKPOINT_SIZE_MAX_AGE_S = 60.0  # how long the newest checkpoint's size (read from the store's catalog) is reused


class StatusReporter:
    def __init__(
        self,
        settings: ConfigSource,
        bus: Bus,
        progress: Progress,
        control: Control,
        ledger: GroupLedger,
        alerts: AlertEvaluator,
        catalog: Callable[[], Awaitable[list[CatalogEntry]]],
        build: BuildInfo,
    ):
        self.settings = settings
        self.bus = bus
        self.progress = progress
        self.control = control
        self.ledger = ledger
        self.alerts = alerts
        self.catalog = catalog
        self.build = build
        self.experience_lag = StageMetrics("trainer", EXPERIENCE)
        self.services: list[SeenService] = []
        self.lag: dict[str, int] = {}  # consumer lag per role, read with the services
        self.scaled_to_zero: set[str] = set()  # roles an operator scaled to 0 replicas (rlpipe scale): not down
        self.services_read = 0.0
        self.created = time.monotonic()
        cfg = settings.cfg
        self.restart_counter = RestartCounter(cfg.supervision.restart_window_s)
        self.disk = DiskWatch(save_paths(cfg.run_dir, cfg.checkpoint_url), cfg.checkpoint.min_free_mib * 2**20)
        self.checkpoint_size_read = -CHECKPOINT_SIZE_MAX_AGE_S

    async def refresh_services(self, max_age_s: float = 5.0) -> list[SeenService]:
        if time.monotonic() - self.services_read > max_age_s:
            try:
                services = await read_presence(self.bus.js, self.settings.cfg.run_id, self.settings.cfg.nats)
                self.services = await self.prune_gone(services)
                self.lag = await self.consumer_lag()
                scale = await read_scale(await self.bus.js.key_value(config_bucket(self.settings.cfg.run_id)))
                self.scaled_to_zero = {role for role, record in scale.items() if record.replicas == 0}
                self.services_read = time.monotonic()
                self.experience_lag.lag(self.lag.get("trainer", 0))
            except (NatsError, TimeoutError) as error:
                log_event(log, Event.PRESENCE_UNREADABLE, level=logging.WARNING, error=repr(error)[:200])
        return self.services

    async def prune_gone(self, services: list[SeenService]) -> list[SeenService]:
        """``services`` less the replicas stopped or silent for over ``supervision.presence_retention_s``, whose
        entries are deleted (journal: ``presence_pruned``); where the broker refuses, they stay listed."""
        cfg = self.settings.cfg
        retention_s = cfg.supervision.presence_retention_s
        gone = gone_for(services, retention_s, spare=presence_key("trainer", instance_name(cfg.service, "trainer")))
        if not gone:
            return services
        try:
            pruned = await prune_presence(self.bus.js, cfg.run_id, cfg.nats, gone)
        except (NatsError, TimeoutError) as error:
            log_event(log, Event.PRESENCE_FAILED, level=logging.WARNING, error=repr(error)[:200])
            return services
        self.control.journal.emit(
            Event.PRESENCE_PRUNED,
            f"no longer listing {len(pruned)} replica(s) stopped or silent for over {retention_s:g}s",
            step=self.progress.step,
            instances=[entry.instance for entry in pruned],
        )
        return [entry for entry in services if entry not in pruned]

    async def consumer_lag(self) -> dict[str, int]:
        """Messages waiting per consuming role: pending plus unacknowledged on its work queue; the trainer's
        unread EXPERIENCE."""
        run_id = self.settings.cfg.run_id
        lag = {}
        for edge, role in WORK_QUEUES.items():
            try:
                info = await self.bus.js.consumer_info(stream_name(run_id, edge), role)
                lag[role] = (info.num_pending or 0) + (info.num_ack_pending or 0)  # the broker always says both
            except (NatsError, TimeoutError):
                continue
        try:
            info = await self.bus.js.stream_info(stream_name(run_id, EXPERIENCE))
            lag["trainer"] = max(info.state.last_seq - self.progress.applied_seq, 0)
        except (NatsError, TimeoutError):
            pass
        return lag

    def roles_down(self, services: list[SeenService]) -> list[str]:
        """Roles without a live replica; one that has never registered counts once the start-up grace is over, one
        scaled to 0 on purpose does not."""
        down = roles_down(services, count_unseen=time.monotonic() - self.created > ROLE_STARTUP_GRACE_S)
        return [role for role in down if role not in self.scaled_to_zero]

    async def services_down(self) -> float:
        return float(len(self.roles_down(await self.refresh_services())))

    async def health_row(self) -> dict[str, float]:
        """The pipeline's health for the alert rules: roles down, roles stalled, the most restarts of one role
        within supervision.restart_window_s, and how many saves the disk still has room for."""
        cfg = self.settings.cfg
        services = await self.refresh_services()
        now = time.time()
        await self.refresh_checkpoint_size()
        restarts = self.restart_counter.observe(services, now)
        free_saves = await asyncio.to_thread(self.disk.free_saves)
        return {
            "services_down": float(len(self.roles_down(services))),
            "roles_stalled": float(len(roles_stalled(services, now, stall_bound_s(cfg.nats)))),
            "role_restarts": float(max(restarts.values(), default=0)),
            "disk_free_saves": round(free_saves, 3),
            # Each role's GPU memory, summed over its live replicas, from their presence entries.
            **role_gpu_memory(services),
            # Each role's busy/idle/blocked fractions since its replicas started, from their presence entries.
            **{
                f"share/{role}/{activity}": round(fraction, 4)
                for role, fractions in role_time_shares(services).items()
                for activity, fraction in fractions.items()
            },
        }

    async def refresh_checkpoint_size(self) -> None:
        if time.monotonic() - self.checkpoint_size_read < CHECKPOINT_SIZE_MAX_AGE_S:
            return
        self.checkpoint_size_read = time.monotonic()
        try:
            catalog = await self.catalog()
        except Exception as error:  # the store's own alerts cover its outages; the last size known stays
            log_event(log, Event.CHECKPOINT_SIZE_UNKNOWN, level=logging.DEBUG, error=repr(error)[:200])
            return
        if catalog:
            self.disk.saw_checkpoint(max(catalog, key=lambda entry: entry.step).bytes)

    async def status(self) -> admin_pb2.Status:
        cfg, progress = self.settings.cfg, self.progress
        services = await self.refresh_services(max_age_s=1.0)
        store_error = ""
        try:
            catalog = await self.catalog()
        except Exception as error:  # an operator needs status most while something is down
            catalog, store_error = [], f"{type(error).__name__}: {error}"[:300]
        live_steps = [e.step for e in catalog if not e.abandoned]
        stable = [e.step for e in catalog if e.stable and not e.abandoned]
        return admin_pb2.Status(
            run_id=cfg.run_id,
            state=self.control.state.value,
            paused_reason=self.control.paused_reason,
            step=progress.step,
            total_steps=cfg.train.total_steps,
            policy_version=progress.version,
            config_version=self.settings.version,
            last_checkpoint_step=max(live_steps, default=-1),
            last_stable_step=max(stable, default=-1),
            services=[self._service(e) for e in services],
            alerts=[admin_pb2.Alert(**_alert_fields(f)) for f in self.alerts.active],
            build_version=self.build.version,
            build_revision=self.build.revision,
            in_flight_groups=len(self.ledger.in_flight),
            last_eval_accuracy=progress.last_eval if progress.last_eval is not None else -1.0,
            environment=cfg.environment or "",
            checkpoint_store_error=store_error,
        )

    def _service(self, entry: SeenService) -> admin_pb2.ServiceStatus:
        return admin_pb2.ServiceStatus(
            instance=entry.instance,
            role=entry.role,
            grpc_address=entry.grpc,
            metrics_url=entry.metrics_url,
            pid=entry.pid,
            config_version=entry.config_version,
            policy_version=entry.policy_version,
            restarts=entry.restarts,
            consumer_lag=self.lag.get(entry.role, 0),
            last_seen_s=entry.last_seen_s,
            up=entry.up,
            stopped=entry.stopped,
            build_version=entry.build_version,
            build_revision=entry.build_revision,
            gpu_allocated_gib=entry.gpu_memory.get("allocated_gb", 0.0),
            gpu_reserved_gib=entry.gpu_memory.get("reserved_gb", 0.0),
            gpu_used_gib=entry.gpu_memory.get("used_gb", 0.0),
        )


class RefusalWatch:
    """Records in the run's events each replica a refusing dependency holds (a rejected or malformed token, TLS,
    DNS: ``Refusal`` in its presence entry), as the alert ``dependency_refused`` naming the refusal's kind, and the
    end of it (``dependency_recovered``). The stage logs its own ``dependency_down`` at once too, but only in its
    own log: the run's events are what the launcher's console, operators and the alert sink (webhook) read. A
    wrong token is no passing outage, so nothing waits for ``ack_wait_s * max_deliver`` here."""

    RULE = "dependency_refused"

    def __init__(self, journal: Journal):
        self.journal = journal
        self.held: dict[str, Refusal] = {}  # instance -> the refusal recorded for it

    def observe(self, services: list[SeenService], step: int) -> None:
        for entry in services:
            recorded = self.held.get(entry.instance)
            if entry.refused is not None and entry.up and (recorded is None or recorded.kind != entry.refused.kind):
                self.held[entry.instance] = entry.refused
                self._refused(entry, entry.refused, step)
            elif entry.refused is None and recorded is not None:
                del self.held[entry.instance]
                self.journal.emit(
                    Event.DEPENDENCY_RECOVERED,
                    f"{entry.instance} ({entry.role}): no dependency refuses it any more",
                    step=step,
                    role=entry.role,
                    instance=entry.instance,
                    refusal=recorded.kind,
                )

    def _refused(self, entry: SeenService, refusal: Refusal, step: int) -> None:
        self.journal.emit(
            Event.DEPENDENCY_REFUSED,
            f"{entry.instance} ({entry.role}) is held: its {refusal.step} is refused ({refusal.kind}), which waiting "
            f"will not fix: {refusal.error}",
            level=logging.ERROR,
            step=step,
            alert=True,
            rule=self.RULE,
            severity="critical",
            role=entry.role,
            instance=entry.instance,
            refusal=refusal.kind,
        )


def _alert_fields(firing: Firing) -> dict[str, Any]:
    fields = firing.as_dict()
    return {
        name: fields[name]
        for name in admin_pb2.Alert.DESCRIPTOR.fields_by_name
        if name in fields and fields[name] is not None
    }


def save_paths(run_dir: Path, checkpoint_url: str) -> list[Path]:
    """Where a save writes on local disks: the run directory, and the store's folder when it is file://
    (an s3:// store reports no free space; its quota is the provider's to watch)."""
    paths = [run_dir]
    parts = urllib.parse.urlsplit(checkpoint_url)
    if parts.scheme == "file":
        paths.append(Path(urllib.parse.unquote(parts.path)))
    return paths
