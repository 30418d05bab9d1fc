"""Stalls that nothing else would report are detected: a stopped role, a hung compute, a stuck loop, a crash loop,
no steps.

The rules are judged on rows as the trainer writes them; the hung compute and the stuck loop run a real
stage on a real nats-server with a real gRPC health server; the stopped role is a rollout SIGSTOPped in a
real pipeline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from services.cli.healthcheck import check
from services.common.config import default_alert_rules, load_config
from services.common.observe.events import Event
from services.common.observe.instruments import DiskWatch
from services.common.observe.records import read_events
from services.common.service import EXIT_STALLED, exit_when_stalled, serve_stage, start_grpc_server
from services.common.transport.bus import Bus
from services.common.transport.messages import RolloutGroup
from services.common.transport.presence import Presence, RestartCounter, SeenService, read_presence, roles_stalled
from services.common.transport.stage import Stage, stall_bound_s
from services.common.transport.streams import DEAD, ROLLOUTS, SCORED, stream_name
from services.trainer.alerts import AlertEvaluator
from services.trainer.status import save_paths
from tests.support.bus import stream_messages, until_messages
from tests.support.messages import rollout_group, scored
from tests.support.paths import ROOT
from tests.support.runs import config_file, metric_rows, run_config, run_info, running_pipeline, wait_for
from tests.support.servers import create_run_state
from tests.support.waits import until

pytestmark = pytest.mark.unit


def fired(rows: list[dict]) -> set[str]:
    evaluator = AlertEvaluator(default_alert_rules(), cooldown_steps=20, now=0.0)
    return {firing.rule for step, row in enumerate(rows) for firing in evaluator.observe({"step": step, **row}, 0.0)}


# ------------------------------------------------------------------ the default rules on the trainer's rows


def test_every_group_scored_alike_for_ten_steps_fires_zero_reward_variance():
    assert fired([{"zero_variance_groups": 1.0}] * 9) == set()
    assert fired([{"zero_variance_groups": 1.0}] * 10) == {"zero_reward_variance"}
    assert fired([{"zero_variance_groups": 1.0}] * 9 + [{"zero_variance_groups": 0.75}]) == set()


def test_stale_applied_groups_fire_staleness_high():
    assert fired([{"staleness_mean": 5.0}] * 10) == {"staleness_high"}
    assert fired([{"staleness_mean": 4.0}] * 10) == set()


def test_status_rows_fire_role_stalled_restart_loop_and_disk_space_low():
    assert fired([{"roles_stalled": 1.0}] * 3) == {"role_stalled"}
    assert fired([{"role_restarts": 4.0}]) == {"restart_loop"}
    assert fired([{"role_restarts": 3.0}]) == set()
    assert fired([{"disk_free_saves": 1.5}]) == {"disk_space_low"}
    assert fired([{"disk_free_saves": 2.5}]) == set()


def test_fifteen_minutes_without_a_step_fires_steps_absent():
    evaluator = AlertEvaluator(default_alert_rules(), cooldown_steps=20, now=0.0)
    evaluator.observe({"step": 1, "step_time_s": 0.5}, now=10.0)
    assert [f.rule for f in evaluator.check_absent(now=10.0 + 900)] == []
    assert [f.rule for f in evaluator.check_absent(now=10.0 + 901)] == ["steps_absent"]


# ------------------------------------------------------------------ presence: stalled roles and restart loops


def entry(role: str, instance: str, up: bool = True, starts: int = 1, **fields) -> SeenService:
    return SeenService(
        role=role, instance=instance, time=0.0, up=up, starts=starts, last_seen_s=0.0, restarts=starts - 1, **fields
    )


def test_a_role_is_stalled_when_no_live_replica_made_progress_within_the_bound():
    now = 1000.0
    entries = [
        entry("reward", "reward-0", progress_time=now - 100),
        entry("reward", "reward-1", progress_time=now - 5),  # one replica moving: the role is not stalled
        entry("rollout", "rollout-0", progress_time=now - 100),
        entry("rollout", "rollout-1", up=False, progress_time=now),  # down: service_down's business
        entry("reference", "reference-0"),  # no progress reported yet (starting): not judged
    ]
    assert roles_stalled(entries, now, bound_s=60.0) == ["rollout"]


def test_restarts_count_per_role_within_the_window_only():
    counter = RestartCounter(window_s=100.0)
    assert counter.observe([entry("reward", "reward-0", starts=3)], now=0.0) == {"reward": 0}  # earlier: unknown
    assert counter.observe([entry("reward", "reward-0", starts=5)], now=50.0) == {"reward": 2}
    both = [entry("reward", "reward-0", starts=6), entry("reward", "reward-1", starts=2)]
    assert counter.observe(both, now=90.0) == {"reward": 3}  # reward-1 seen first at 2 starts: 0 of its own
    # At 160 the window starts at 60: the restarts at 50 fall out, the one at 90 stays.
    assert counter.observe(both, now=160.0) == {"reward": 1}
    assert counter.observe(both, now=250.0) == {"reward": 0}


# ------------------------------------------------------------------ a hung compute, a stuck loop


def capped_config(tmp_path, tiny_model, nats_url):
    """Computes capped at half a second, two deliveries each."""
    nats = {"url": nats_url, "ack_wait_s": 5, "heartbeat_s": 1, "max_deliver": 2, "fetch_timeout_s": 0.3}
    return run_config(tmp_path, tiny_model, run_id="faults", nats={**nats, "max_work_s": 0.5})


@pytest.mark.integration
def test_a_compute_that_hangs_is_abandoned_after_max_work_s_and_dead_lettered_as_timeout(
    tiny_model, tmp_path, nats_url, caplog
):
    cfg = capped_config(tmp_path, tiny_model, nats_url)
    never = threading.Event()  # a reward function blocked for good, as on a wedged remote call

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "reward").connect()
        await bus.publish(ROLLOUTS, rollout_group("hangs"), msg_id="hangs.rollout")

        async def compute(groups):
            await asyncio.to_thread(never.wait)
            return [scored(g) for g in groups]

        stop = asyncio.Event()
        task = asyncio.create_task(Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 1, "reward").run(stop))
        try:
            await until_messages(bus, DEAD, 1)
            stop.set()
            await task
        finally:
            never.set()  # the abandoned threads end, or asyncio.run would wait for them at exit
        assert await stream_messages(bus, DEAD) == 1 and await stream_messages(bus, SCORED) == 0
        letter = await bus.js.get_msg(stream_name("faults", DEAD), seq=1)
        assert letter.headers["Rlpipe-Group-Id"] == "hangs"
        assert letter.headers["Rlpipe-Reason"].startswith("timeout: compute of 1 message(s) took longer than")
        assert "on each of 2 deliveries" in letter.headers["Rlpipe-Reason"]
        await bus.close()

    caplog.set_level("WARNING")
    asyncio.run(scenario())
    timeouts = [r for r in caplog.records if r.getMessage() == "work_timed_out"]
    assert len(timeouts) == 2  # one per delivery, the first nakked with backoff, the second dead-lettered


@pytest.mark.integration
def test_a_stage_whose_loop_is_stuck_reports_not_serving_and_stalled(tiny_model, tmp_path, nats_url):
    cfg = capped_config(tmp_path, tiny_model, nats_url)
    assert stall_bound_s(cfg.nats) == pytest.approx(1.3)

    async def scenario() -> None:
        await create_run_state(cfg)
        bus = await Bus(cfg, "reward").connect()
        server, address = await start_grpc_server(cfg, 0)
        presence = await Presence(bus.js, cfg, "reward").start(grpc=address)
        release = asyncio.Event()

        async def compute(groups):
            # Ignores being abandoned: the cap cannot free the loop, only a restart can.
            while not release.is_set():
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    continue
            return [scored(g) for g in groups]

        stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, 1, "reward")
        stop = asyncio.Event()
        task = asyncio.create_task(serve_stage(stage, stop, server, presence))
        # A fixed wait, since what it shows is a state that lasts: idle and fetching for a while, still SERVING.
        await asyncio.sleep(1.0)
        assert await asyncio.to_thread(check, address) is None

        await bus.publish(ROLLOUTS, rollout_group("stuck"), msg_id="stuck.rollout")
        reason = None
        for _ in range(100):
            reason = await asyncio.to_thread(check, address)
            if reason:
                break
            await asyncio.sleep(0.1)
        assert reason == f"{address}: NOT_SERVING"

        async def stalled_in_presence() -> bool:  # a presence heartbeat carries the standing progress time
            entries = await read_presence(bus.js, cfg.run_id, cfg.nats)
            return roles_stalled(entries, time.time(), stall_bound_s(cfg.nats)) == ["reward"]

        await until(stalled_in_presence, 30, "the stall seen in presence", poll=0.2)

        release.set()  # the compute returns: the loop moves and health comes back
        for _ in range(100):
            reason = await asyncio.to_thread(check, address)
            if reason is None:
                break
            await asyncio.sleep(0.1)
        assert reason is None
        assert await stream_messages(bus, SCORED) == 1
        stop.set()
        await task

    asyncio.run(scenario())


@pytest.mark.integration
def test_a_stage_stalled_past_exit_when_stalled_s_exits_for_its_restart_policy(config_only_model, tmp_path, nats_url):
    nats = {"url": nats_url, "ack_wait_s": 5, "heartbeat_s": 1, "max_deliver": 2, "fetch_timeout_s": 0.3}
    path = config_file(
        tmp_path,
        config_only_model,
        run_id="faults",
        nats={**nats, "max_work_s": 0.5},
        service={"exit_when_stalled_s": 1.0},
    )
    cfg = load_config(path)
    code = (
        "import sys; from services.common.service import run_service; "
        "from tests.common.blocking_stage import event_loop_blocking_stage; "
        f"sys.argv = ['reward', '--config', {str(path)!r}]; run_service('reward', event_loop_blocking_stage)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:

        async def feed() -> None:
            await create_run_state(cfg)
            bus = await Bus(cfg, "rollout").connect()
            await bus.publish(ROLLOUTS, rollout_group("blocks"), msg_id="blocks.rollout")
            await bus.close()

        asyncio.run(feed())
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert process.returncode == EXIT_STALLED, stderr[-2000:]
    (exit_line,) = [line for line in lines if line.get("event") == "stalled_exit"]
    assert exit_line["level"] == "CRITICAL" and exit_line["exit_code"] == EXIT_STALLED
    assert exit_line["no_progress_s"] > stall_bound_s(cfg.nats) + 1.0


def test_no_stall_exit_thread_runs_unless_asked():
    class Stuck:
        last_progress = 0.0

        def stalled_for(self, now: float) -> float:
            return now

    before = threading.active_count()
    with exit_when_stalled(Stuck(), 0.0, check_every_s=0.01):
        assert threading.active_count() == before  # a thread here would end this process at its first check


# ------------------------------------------------------------------ a real pipeline with a SIGSTOPped rollout


@pytest.mark.e2e
def test_a_sigstopped_rollout_fires_steps_absent_and_service_down(tiny_model, tmp_path):
    runs = tmp_path / "runs"
    rules = [
        rule.model_dump() | ({"window_s": 30.0} if rule.name == "steps_absent" else {})
        for rule in default_alert_rules()
    ]
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="stall",
        train={"total_steps": 1000, "max_inflight_batches": 1},
        checkpoint={"save_every_steps": 0},
        alerts={"rules": rules, "cooldown_steps": 0},  # a rule that fired while starting up may fire again
    )
    run_dir = runs / "stall"
    with running_pipeline(config) as process:
        wait_for(lambda: len([r for r in metric_rows(run_dir) if r.is_step]) >= 2, "the first steps", process)
        rollout = run_info(run_dir, process)["pids"]["rollout-0"]
        stopped_at = time.time()
        os.kill(rollout, signal.SIGSTOP)
        try:
            alerts = lambda: [  # noqa: E731
                e
                for e in read_events(run_dir / "events.jsonl")
                if e.kind == Event.ALERT and e.time is not None and e.time > stopped_at
            ]
            fired = lambda: {e.rule for e in alerts()}  # noqa: E731
            wait_for(lambda: {"steps_absent", "service_down"} <= fired(), "the stall alerts", process, timeout=240)
        finally:
            os.kill(rollout, signal.SIGCONT)
    absent = next(e for e in alerts() if e.rule == "steps_absent")
    assert absent.details["metric"] == "step_time_s" and absent.details["severity"] == "critical"
    assert "has not been reported for" in absent.message


# ------------------------------------------------------------------ a disk filling up


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: a disk that really fills up (mounting needs root, as in the CI container)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True)
    # Not skipped where mounting fails: the disk-space alert would then go untested without anyone noticing.
    assert done.returncode == 0, f"this test needs root to mount a 2 MiB tmpfs: {done.stderr.decode().strip()}"
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.integration
def test_a_filling_disk_fires_disk_space_low_before_a_save_fails(small_disk):
    runs = small_disk / "runs"
    watch = DiskWatch(save_paths(runs / "run-1", "s3://bucket/prefix"), min_free_bytes=512 * 1024)
    assert watch.paths == [runs.resolve() / "run-1"]  # an s3:// store reports no free space: not watched
    assert watch.free_saves() == pytest.approx(4.0, abs=0.1)
    assert fired([{"disk_free_saves": watch.free_saves()}]) == set()

    (small_disk / "filler").write_bytes(b"\0" * (1280 * 1024))  # 0.75 MiB left: one save more fits, not two
    assert fired([{"disk_free_saves": watch.free_saves()}]) == {"disk_space_low"}
    # A checkpoint larger than the configured minimum raises what a save needs; a smaller one does not lower it.
    watch.saw_checkpoint(640 * 1024)
    assert watch.free_saves() == pytest.approx(1.2, abs=0.05)
    watch.saw_checkpoint(100 * 1024)
    assert watch.free_saves() == pytest.approx(1.5, abs=0.05)


def test_a_file_store_is_watched_beside_the_run_directory(tmp_path):
    store = tmp_path / "store dir"
    assert save_paths(tmp_path / "runs" / "r", store.as_uri()) == [tmp_path / "runs" / "r", store]
