"""The status reporter alone, against a real nats-server: lag from JetStream, state from control, store trouble."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from services.common.config import BuildInfo
from services.common.observe.events import EventLog, Journal
from services.common.transport.bus import Bus
from services.common.transport.presence import (
    Presence,
    SeenService,
    ServiceEntry,
    instance_name,
    open_bucket,
    presence_key,
    read_presence,
)
from services.common.transport.streams import EXPERIENCE, PROMPTS
from services.trainer.alerts import AlertEvaluator
from services.trainer.checkpointing.manifest import CatalogEntry
from services.trainer.control import Control
from services.trainer.intake.ledger import GroupLedger
from services.trainer.progress import Progress
from services.trainer.status import ROLE_STARTUP_GRACE_S, StatusReporter
from tests.support.messages import experience_group, prompt
from tests.support.runs import run_config
from tests.support.trainer import Holds

pytestmark = pytest.mark.integration


def test_status_reports_lag_state_in_flight_and_a_checkpoint_store_that_is_down(tiny_model, tmp_path, nats_url):
    cfg = run_config(tmp_path, tiny_model, run_id="st", nats={"url": nats_url})

    async def store_down() -> list[dict]:
        raise ConnectionError("minio unreachable")

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        await bus.work_queue(PROMPTS)  # the rollout role's durable consumer, as a rollout would create it
        for i in range(3):
            await bus.publish(PROMPTS, prompt(f"g{i}"), f"p{i}")
        for i in range(5):
            await bus.publish(EXPERIENCE, experience_group(f"x{i}"), msg_id=f"x{i}")
        progress = Progress(step=4, version=6, applied_seq=2)
        control = Control(Holds(), Journal(EventLog(tmp_path / "events.jsonl")), progress)
        await control.pause("looking at KL")
        ledger = GroupLedger()
        for group in ("a", "b"):
            ledger.fed(group, now=0.0)
        settings = type("Settings", (), {"cfg": cfg, "version": 7})()
        reporter = StatusReporter(
            settings, bus, progress, control, ledger, AlertEvaluator([], 0), store_down, BuildInfo(version="t")
        )
        status = await reporter.status()
        assert (status.state, status.paused_reason, status.step, status.policy_version) == (
            "paused",
            "looking at KL",
            4,
            6,
        )
        assert (status.config_version, status.in_flight_groups, status.last_checkpoint_step) == (7, 2, -1)
        assert status.checkpoint_store_error == "ConnectionError: minio unreachable"
        assert reporter.lag == {"rollout": 3, "trainer": 3}  # 3 prompts waiting; EXPERIENCE 5 written, 2 applied
        await bus.close()

    asyncio.run(scenario())


def test_a_role_that_never_registered_counts_as_down_only_after_the_start_up_grace(tiny_model, tmp_path):
    cfg = run_config(tmp_path, tiny_model)
    settings = type("Settings", (), {"cfg": cfg, "version": 0})()
    progress = Progress()

    async def no_catalog() -> list[dict]:
        return []

    reporter = StatusReporter(
        settings, None, progress, None, GroupLedger(), AlertEvaluator([], 0), no_catalog, BuildInfo()
    )
    trainer_only = [SeenService(role="trainer", instance="trainer", time=0.0, last_seen_s=0.0, up=True, restarts=0)]
    assert reporter.roles_down(trainer_only) == []  # rollouts may still be loading their engines
    reporter.created = time.monotonic() - ROLE_STARTUP_GRACE_S - 1
    assert reporter.roles_down(trainer_only) == ["rollout", "reward", "reference"]


def test_replicas_stopped_or_silent_past_the_retention_are_no_longer_listed_and_come_back_when_they_beat(
    tiny_model, tmp_path, nats_url
):
    retention = {"presence_retention_s": 600}
    cfg = run_config(tmp_path, tiny_model, run_id="prune", nats={"url": nats_url}, supervision=retention)
    now = time.time()
    own = instance_name(cfg.service, "trainer")
    entries = {
        "rollout-live": ServiceEntry(role="rollout", instance="rollout-live", time=now),
        "rollout-scaled-in": ServiceEntry(role="rollout", instance="rollout-scaled-in", time=now - 3600, stopped=True),
        "reward-crashed": ServiceEntry(role="reward", instance="reward-crashed", time=now - 3600),
        "reward-left-lately": ServiceEntry(role="reward", instance="reward-left-lately", time=now - 60, stopped=True),
        own: ServiceEntry(role="trainer", instance=own, time=now - 3600),  # never its own, however old
    }

    async def scenario() -> None:
        bus = await Bus(cfg, "trainer").connect()
        kv = await open_bucket(bus.js, cfg.run_id, cfg.nats)
        for entry in entries.values():
            await kv.put(presence_key(entry.role, entry.instance), entry.model_dump_json().encode())
        progress = Progress(step=9)
        control = Control(Holds(), Journal(EventLog(tmp_path / "events.jsonl")), progress)

        async def no_catalog() -> list[CatalogEntry]:
            return []

        settings = type("Settings", (), {"cfg": cfg, "version": 0})()
        reporter = StatusReporter(
            settings, bus, progress, control, GroupLedger(), AlertEvaluator([], 0), no_catalog, BuildInfo()
        )
        listed = {entry.instance for entry in await reporter.refresh_services(max_age_s=0)}
        assert listed == {"rollout-live", "reward-left-lately", own}
        assert {entry.instance for entry in await read_presence(bus.js, cfg.run_id, cfg.nats)} == listed
        rows = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        (pruned,) = [row for row in rows if row["kind"] == "presence_pruned"]
        assert (pruned["instances"], pruned["step"]) == (["reward-crashed", "rollout-scaled-in"], 9)

        # A pruned replica that comes back is listed again, as a first start.
        returned = cfg.model_copy(update={"service": cfg.service.model_copy(update={"instance": "reward-crashed"})})
        presence = await Presence(bus.js, returned, "reward").start()
        again = {entry.instance: entry for entry in await reporter.refresh_services(max_age_s=0)}
        assert again["reward-crashed"].up and again["reward-crashed"].restarts == 0
        await presence.stop()
        await bus.close()

    asyncio.run(scenario())
