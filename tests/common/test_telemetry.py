"""Telemetry in a real process: a stage over real NATS, its Prometheus endpoint scraped over HTTP,
its spans and metrics received by a real OTLP/gRPC server.

OpenTelemetry's global providers can be set once per process, so the instrumented side
runs as a child process (``DRIVER``), as every service does; the test holds the receiver.
"""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys

import pytest

from tests.support.paths import ROOT
from tests.support.telemetry import OtlpReceiver, minimal_config, one_value, scrape, values

pytestmark = pytest.mark.integration


# The instrumented process: a rollout-like stage over real NATS with one good, one flaky and one
# undecodable message, then a trainer-like reader of its output. Prints its metrics URL, waits for
# a line on stdin, then shuts telemetry down (which flushes spans and a last metrics export).
DRIVER = r"""
import asyncio, json, sys, time
import numpy as np
from services.common.transport.bus import Bus
from services.common.transport.reader import StreamReader
from services.common.transport.stage import Stage
from services.common.transport.streams import PROMPTS, ROLLOUTS, subject
from services.common.config import load_config
from services.common.transport.messages import Completion, Prompt, RolloutGroup, advance
from services.common.observe.instruments import TrainerMetrics, record_weight_sync
from services.common.observe.telemetry import span_from_headers, start_telemetry

cfg = load_config(sys.argv[1])
telemetry = start_telemetry(cfg, "rollout", "rollout-test")
assert start_telemetry(cfg, "reward", "someone-else") is telemetry
failures = {"g-flaky": 2}  # fails in its batch and alone, then a nak; the redelivery succeeds

async def compute(prompts):
    for p in prompts:
        if failures.get(p.group_id, 0) > 0:
            failures[p.group_id] -= 1
            raise RuntimeError("flaky")
    completion = Completion(
        text="2", token_ids=np.array([5], np.int32), logprobs=np.array([-0.1], np.float32), finish_reason="stop"
    )
    return [
        advance(p, RolloutGroup, prompt_ids=np.array([1], np.int32), policy_version=0, completions=[completion])
        for p in prompts
    ]

async def main():
    await (await Bus(cfg, "trainer").connect()).close()  # the trainer creates the streams a stage waits for
    bus = await Bus(cfg, "rollout").connect()
    with span_from_headers("test.feed", None):
        for group_id in ("g-ok", "g-flaky"):
            prompt = Prompt(group_id=group_id, prompt_id=group_id, prompt="1+1=", answer="2")
            await bus.publish(PROMPTS, prompt, msg_id=group_id + ".prompt")
    await bus.js.publish(subject(cfg.run_id, PROMPTS), b"\x00 not msgpack")
    stage = Stage(bus, PROMPTS, ROLLOUTS, Prompt, compute, batch=4, name="rollout")
    stop = asyncio.Event()
    running = asyncio.create_task(stage.run(stop))
    deadline = time.monotonic() + 60
    while stage.handled < 2:
        assert time.monotonic() < deadline and not running.done(), "stage did not handle both prompts"
        await asyncio.sleep(0.1)
    stop.set()
    await running
    reader = StreamReader(bus, ROLLOUTS, 1)
    for _ in range(2):
        msg = await reader.next(timeout=10)
        with span_from_headers("trainer.experience", msg.headers, seq=msg.sequence):
            pass
    await bus.close()

asyncio.run(main())
record_weight_sync(0.5, 4096, 3)
trainer = TrainerMetrics()
step = {"step": 7, "entropy": 1.5, "reward_mean": 0.25, "grad_norm": np.float32(0.75), "loss": float("nan")}
trainer.record_step({**step, "note": "text"})
trainer.record_checkpoint(1.2, ok=True)
trainer.record_checkpoint(0.4, ok=False)
trainer.record_checkpoint_stall(0.03)
trainer.record_alert("kl_too_high", "warning")
from services.common.observe.writer import BackgroundWriter
closed = BackgroundWriter("metrics", lambda rows: None)
closed.close()
closed.put({"step": 8})
closed.put({"step": 9})
import logging
logging.getLogger("driver").error("one error for the log error rate")
print(json.dumps({"metrics_url": telemetry.metrics_url}), flush=True)
sys.stdin.readline()
telemetry.shutdown()
"""


def children_cpu_seconds() -> float:
    """User and system CPU seconds of every child this process has reaped."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def test_stage_metrics_scrape_and_one_trace_across_the_bus(tmp_path, nats_url):
    receiver = OtlpReceiver()
    config = minimal_config(
        tmp_path,
        nats={"url": nats_url, "ack_wait_s": 30, "max_deliver": 3, "duplicate_window_s": 600, "fetch_timeout_s": 0.5},
        telemetry={"otlp_endpoint": receiver.endpoint, "export_interval_s": 60},
    )
    reaped_before = children_cpu_seconds()
    with (tmp_path / "driver.log").open("w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(config)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            line = driver.stdout.readline()
            assert line, (tmp_path / "driver.log").read_text()
            url = json.loads(line)["metrics_url"]
            assert url.startswith("http://127.0.0.1:") and not url.startswith("http://127.0.0.1:0/")
            samples = scrape(url)
            driver.stdin.write("\n")
            driver.stdin.flush()
            assert driver.wait(timeout=30) == 0, (tmp_path / "driver.log").read_text()
            driver_cpu_s = children_cpu_seconds() - reaped_before  # the kernel's count over its whole life
        finally:
            if driver.poll() is None:
                driver.kill()
    receiver.stop()

    stage = {"role": "rollout", "edge": "prompts"}
    assert one_value(samples, "rlpipe_groups_processed_total", outcome="ok", **stage) == 2
    assert one_value(samples, "rlpipe_groups_processed_total", outcome="dead", **stage) == 1
    assert one_value(samples, "rlpipe_groups_processed_total", outcome="retry", **stage) >= 1
    assert one_value(samples, "rlpipe_stage_latency_seconds_count", outcome="ok", **stage) == 2
    assert 0 < one_value(samples, "rlpipe_stage_latency_seconds_sum", outcome="ok", **stage) < 60
    assert one_value(samples, "rlpipe_stage_latency_seconds_bucket", outcome="ok", le="+Inf", **stage) == 2
    assert one_value(samples, "rlpipe_consumer_lag", **stage) == 0  # everything was consumed
    assert one_value(samples, "rlpipe_dead_letters_total", reason="undecodable", **stage) == 1
    assert one_value(samples, "rlpipe_process_resident_memory_bytes") > 10e6
    # The driver's own CPU time so far: some, and no more than the kernel counted for its whole life (one clock
    # tick of slack: /proc counts in ticks).
    assert 0 < one_value(samples, "rlpipe_process_cpu_seconds_total") <= driver_cpu_s + 0.01
    assert one_value(samples, "rlpipe_log_records_total", level="error") == 1
    assert (
        one_value(samples, "rlpipe_log_records_total", level="warning") >= 2
    )  # the dead letter and the failed compute
    assert one_value(samples, "rlpipe_weight_sync_duration_seconds_sum") == 0.5
    assert one_value(samples, "rlpipe_weight_sync_bytes_total") == 4096
    assert one_value(samples, "rlpipe_rollout_policy_version") == 3
    assert one_value(samples, "rlpipe_trainer_entropy") == 1.5
    assert one_value(samples, "rlpipe_trainer_reward_mean") == 0.25
    assert one_value(samples, "rlpipe_trainer_grad_norm") == 0.75
    assert one_value(samples, "rlpipe_trainer_step") == 7
    assert values(samples, "rlpipe_trainer_loss") == []  # NaN is left out, and counted
    assert one_value(samples, "rlpipe_trainer_nonfinite_metrics_total", metric="loss") == 1
    assert one_value(samples, "rlpipe_checkpoints_total", outcome="ok") == 1
    assert one_value(samples, "rlpipe_checkpoints_total", outcome="failed") == 1
    assert one_value(samples, "rlpipe_checkpoint_duration_seconds_sum", outcome="failed") == 0.4
    assert one_value(samples, "rlpipe_checkpoint_stall_seconds_sum") == 0.03
    assert one_value(samples, "rlpipe_alerts_fired_total", rule="kl_too_high", severity="warning") == 1
    assert one_value(samples, "rlpipe_metrics_dropped_total", writer="metrics") == 2
    [target] = [s for s in samples if s.name == "target_info"]
    assert target.labels["service_name"] == "rlpipe-rollout" and target.labels["rlpipe_run_id"] == "tele"
    assert target.labels["service_instance_id"] == "rollout-test"

    # The shutdown flushed a last OTLP metrics export.
    assert {
        "rlpipe_groups_processed",
        "rlpipe_stage_latency",
        "rlpipe_process_resident_memory",
    } <= receiver.metric_names

    # Each group: feed span -> stage span (one per delivery) -> reader span, all in one trace.
    [feed] = receiver.by_name("test.feed")
    assert feed.service == "rlpipe-rollout"
    stage_spans = receiver.by_name("rollout.prompts")
    readers = receiver.by_name("trainer.experience")
    assert len(readers) == 2
    for reader in readers:
        [parent] = [s for s in stage_spans if s.span_id == reader.parent_span_id]
        assert parent.attributes["rlpipe.outcome"] == "ok"
        assert parent.trace_id == reader.trace_id == feed.trace_id
        assert parent.parent_span_id == feed.span_id
    flaky = sorted(
        (s for s in stage_spans if s.attributes.get("rlpipe.group_id") == "g-flaky"),
        key=lambda s: s.attributes["rlpipe.delivery"],
    )
    assert [s.attributes["rlpipe.delivery"] for s in flaky] == list(range(1, len(flaky) + 1))
    assert [s.attributes["rlpipe.outcome"] for s in flaky] == ["retry"] * (len(flaky) - 1) + ["ok"] and len(flaky) >= 2
    assert all(s.trace_id == feed.trace_id for s in flaky)
    [dead] = [s for s in stage_spans if s.attributes["rlpipe.outcome"] == "dead"]
    assert dead.error and dead.trace_id != feed.trace_id  # published without a span: its own root


def test_a_taken_metrics_port_stops_a_service_with_a_clear_message(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = minimal_config(tmp_path, telemetry={"metrics_port": port})
        done = subprocess.run(
            [sys.executable, "-m", "services.reward", "--config", str(config)],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stderr
    # The start-up checks catch it before the metrics server tries to bind.
    assert f"telemetry.metrics_port {port} on 127.0.0.1: Address already in use" in done.stderr
