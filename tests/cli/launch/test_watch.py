"""What the launcher reads of its run: readiness from presence entries on a real broker with the run's keys, steps
and ``done`` from the files the trainer appends to."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.cli.launch.children import Child
from services.cli.launch.launcher import Launcher
from services.cli.launch.watch import PresenceWatch, RunRecord
from services.common.config import RunConfig, load_config
from services.common.observe.events import Event
from services.common.observe.records import MetricsRow, RunDone
from services.common.service import announce_ready
from services.common.transport.bus import Bus
from services.common.transport.nats_auth import RoleKey
from services.common.transport.presence import Presence, open_bucket
from tests.support.paths import ROOT
from tests.support.runs import config_file, run_config
from tests.support.servers import keyed_nats


@pytest.fixture
def secured(config_only_model, tmp_path: Path) -> Iterator[tuple[RunConfig, dict[str, RoleKey]]]:
    """A broker with the run's per-role keys, as the launcher starts it, and the config of a reward replica."""
    with keyed_nats(tmp_path) as (url, keys):
        cfg = load_config(
            config_file(tmp_path, config_only_model),
            nats={"url": url},
            service={"instance": "reward-0"},
        )
        yield cfg, keys


def seen_within(watch: PresenceWatch, condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.integration
def test_a_replica_is_ready_once_its_own_entry_carries_its_startup_report(secured):
    cfg, keys = secured
    as_trainer = cfg.model_copy(
        update={"nats": cfg.nats.model_copy(update={"nkey_seed_file": keys["trainer"].seed_file})}
    )
    spawned_at = time.time()
    watch = PresenceWatch(cfg, cfg.nats.url, keys["operator"].seed_file).start()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:

        async def starting() -> tuple[Bus, Presence]:
            bus = await Bus(as_trainer, "trainer").connect()
            # The trainer creates the bucket, as at a run's start.
            await open_bucket(bus.js, as_trainer.run_id, as_trainer.nats)
            return bus, await Presence(bus.js, as_trainer, "reward").start(grpc="127.0.0.1:1")

        loop = asyncio.new_event_loop()
        bus, presence = loop.run_until_complete(starting())
        # Registered, serving nothing yet: an entry without its start-up report is not ready.
        assert seen_within(watch, lambda: watch.entry("reward", "reward-0") is not None)
        assert watch.ready_entry("reward", "reward-0", os.getpid(), spawned_at) is None

        loop.run_until_complete(announce_ready(presence, grpc="127.0.0.1:1", model_load_s=1.5, backend="hf"))
        assert watch.await_reading(timeout_s=10)  # one that began after the announcement
        entry = watch.ready_entry("reward", "reward-0", os.getpid(), spawned_at)
        assert entry is not None and entry.grpc == "127.0.0.1:1"
        startup = dict(entry.startup)
        assert startup.pop("ready_at") >= spawned_at
        # The process computes with torch (imported here), so its report names the threads torch uses.
        assert startup.pop("torch_threads") == torch.get_num_threads()
        assert startup == {"grpc": "127.0.0.1:1", "model_load_s": 1.5, "backend": "hf"}
        # Written by a process the launched one started (a torchrun trainer's rank): this one, below its parent.
        assert watch.ready_entry("reward", "reward-0", os.getppid(), spawned_at) is not None
        # Written by another process than the one asked about, or before it started: a predecessor's entry.
        assert watch.ready_entry("reward", "reward-0", other.pid, spawned_at) is None
        assert watch.ready_entry("reward", "reward-0", os.getpid(), time.time() + 60) is None
        # Another role's replica of the same name: not this entry, which only a reward (or the trainer) may write.
        assert watch.ready_entry("rollout", "reward-0", os.getpid(), spawned_at) is None
        loop.run_until_complete(presence.stop())
        loop.run_until_complete(bus.close())
        loop.close()
    finally:
        other.kill()
        other.wait()
        watch.close()


@pytest.mark.unit
def test_the_record_reads_only_what_is_written_after_the_launch(config_only_model, tmp_path):
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    metrics, events = run_dir / "metrics.jsonl", run_dir / "events.jsonl"
    # A resumed run's earlier rows, done included: not news to this launch.
    metrics.write_text(json.dumps({"step": 3, "reward_mean": 0.1, "entropy": 1.0, "kl_ref": 0.0}) + "\n")
    events.write_text(json.dumps({"kind": "done", "step": 3, "steps": 3}) + "\n")
    cfg = run_config(tmp_path, config_only_model, run_id="r")
    record = RunRecord.of_run(cfg)
    assert record.new_steps() == ([], []) and record.new_events() == [] and record.done is None

    with metrics.open("a") as out:
        out.write(json.dumps({"step": 4, "reward_mean": 0.5, "entropy": 0.9, "kl_ref": 0.01}) + "\n")
        out.write(json.dumps({"step": 4, "eval_accuracy": 0.6}) + "\n")
        out.write(json.dumps({"step": 4, "checkpoint_saved": 1}) + "\n")
    with events.open("a") as out:
        out.write(json.dumps({"kind": "pause", "step": 4, "message": "operator"}) + "\n")
        out.write(json.dumps({"kind": "done", "step": 4, "steps": 4}) + "\n")
    steps, evaluations = record.new_steps()
    assert [row.step for row in steps] == [4] and evaluations == [MetricsRow({"step": 4, "eval_accuracy": 0.6})]
    assert [event.kind for event in record.new_events()] == [Event.PAUSE, Event.DONE]
    assert record.done == RunDone(steps=4)


# A stage that reports itself ready on the run's broker (with the reward role's key) and drains for half a second
# after SIGTERM, exiting 0, as a stage does.
READY_THEN_DRAINS = """
import asyncio, signal, sys
from services.common.config import load_config
from services.common.service import announce_ready
from services.common.transport.bus import Bus
from services.common.transport.presence import Presence

nats = {"url": sys.argv[2], "nkey_seed_file": sys.argv[3]}
cfg = load_config(sys.argv[1], nats=nats, service={"instance": "reward-0"})

async def main():
    bus = await Bus(cfg, "reward").connect()
    presence = await Presence(bus.js, cfg, "reward").start(grpc="127.0.0.1:1")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await announce_ready(presence, grpc="127.0.0.1:1")
    print("ready", flush=True)
    await stop.wait()
    await asyncio.sleep(0.5)

asyncio.run(main())
"""


@pytest.mark.integration
def test_a_stage_ready_before_the_launcher_read_it_gets_its_stop_grace_instead_of_a_kill(secured, tmp_path):
    """A run done before the launcher read a stage's ready entry (wait_ready stops waiting once the trainer is done)
    stops that stage as a ready one: it drains and exits 0, and the run reports no failed service."""
    cfg, keys = secured
    as_trainer = cfg.model_copy(
        update={"nats": cfg.nats.model_copy(update={"nkey_seed_file": keys["trainer"].seed_file})}
    )

    async def create_bucket() -> None:  # the trainer's part at a run's start
        bus = await Bus(as_trainer, "trainer").connect()
        await open_bucket(bus.js, as_trainer.run_id, as_trainer.nats)
        await bus.close()

    asyncio.run(create_bucket())
    config = tmp_path / "c.yaml"
    stage = subprocess.Popen(
        [sys.executable, "-c", READY_THEN_DRAINS, str(config), cfg.nats.url, str(keys["reward"].seed_file)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    launcher = Launcher(cfg, config, resume=False)
    try:
        assert stage.stdout.readline() == "ready\n"
        child = Child("reward-0", "reward", stage, tmp_path / "reward-0.log", log_max_bytes=2**20, log_keep=1)
        child.spawned_at = 0.0  # the entry was written after the launch
        launcher.children = [child]
        launcher.presence = PresenceWatch(cfg, cfg.nats.url, keys["operator"].seed_file).start()
        assert child.ready is None  # never seen ready: killed at once without a fresh reading
        assert launcher.stop() == []
        assert stage.returncode == 0
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait()
