"""Observability of a real run: `rlpipe run` with every service exporting to an OTLP/gRPC receiver held by the test.

While it trains, each service's Prometheus endpoint (from run.json) is scraped over HTTP
and must show its metrics with finite values; one undecodable message per stage input
shows up as a dead letter of that stage. The run is then stopped as a supervisor would
(SIGTERM), every service flushes its telemetry on the way out, and the receiver must
hold one group's spans from rollout, reward, reference and trainer in a single trace.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import nats
import pytest
from prometheus_client.samples import Sample

from services.cli.dead_letters import operator_options
from services.common.transport.streams import EXPERIENCE, PROMPTS, ROLLOUTS, SCORED, subject
from tests.support.runs import config_file, running_pipeline
from tests.support.telemetry import OtlpReceiver, one_value, scrape, values

pytestmark = pytest.mark.e2e

TOTAL_STEPS = 500  # never reached: the test stops the run once it has scraped every service
# service name in run.json -> (role, edge it consumes)
CONSUMERS = {
    "rollout-0": ("rollout", PROMPTS),
    "reward-0": ("reward", ROLLOUTS),
    "reference-0": ("reference", SCORED),
    "trainer": ("trainer", EXPERIENCE),
}
STAGES = ("rollout-0", "reward-0", "reference-0")
TRAINER_GAUGES = (
    "entropy",
    "reward_mean",
    "reward_std",
    "kl_ref",
    "response_length_mean",
    "termination_rate",
    "clipfrac",
    "grad_norm",
    "learning_rate",
    "step_time_s",
    "tokens_per_s",
    "staleness_mean",
    "step",
)
SPAN_CHAIN = (
    ("rollout.prompts", "rlpipe-rollout"),
    ("reward.rollouts", "rlpipe-reward"),
    ("reference.scored", "rlpipe-reference"),
    ("trainer.experience", "rlpipe-trainer"),
)


async def inject_undecodable(nats_url: str, run_id: str, options: dict) -> None:
    nc = await nats.connect(nats_url, **options)
    js = nc.jetstream()
    for _, edge in CONSUMERS.values():
        await js.publish(subject(run_id, edge), b"\x00\xffnot-msgpack")
    await nc.close()


def wait_for_run_file(run_dir: Path, process, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while not (run_dir / "run.json").exists():
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "services not ready within 10 minutes"
        time.sleep(0.5)
    return json.loads((run_dir / "run.json").read_text())


def scrape_until(
    targets: dict[str, tuple[str, Callable[[list[Sample]], bool]]], timeout: float = 300
) -> dict[str, list[Sample]]:
    """Scrape every ``name -> (url, done)`` until each ``done`` holds or ``timeout`` passes.

    Returns each service's last scrape either way; the assertions then say what is missing.
    """
    deadline = time.monotonic() + timeout
    scraped: dict[str, list[Sample]] = {}
    waiting = dict(targets)
    while waiting:
        for name, (url, done) in list(waiting.items()):
            scraped[name] = scrape(url)
            if done(scraped[name]):
                del waiting[name]
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return scraped


def stage_done(role: str, edge: str) -> Callable[[list[Sample]], bool]:
    return lambda samples: (
        sum(values(samples, "rlpipe_groups_processed_total", role=role, edge=edge, outcome="ok")) > 0
        and sum(values(samples, "rlpipe_dead_letters_total", role=role, edge=edge)) > 0
        and (role != "rollout" or sum(values(samples, "rlpipe_weight_sync_duration_seconds_count")) > 0)
    )


def trainer_done(samples: list[Sample]) -> bool:
    return (
        sum(values(samples, "rlpipe_checkpoints_total", outcome="ok")) > 0
        and sum(values(samples, "rlpipe_dead_letters_total", role="trainer")) > 0
        and all(values(samples, f"rlpipe_trainer_{key}") for key in TRAINER_GAUGES)
    )


def assert_service_basics(samples: list[Sample]) -> None:
    assert one_value(samples, "rlpipe_process_resident_memory_bytes") > 10e6


def assert_stage(samples: list[Sample], role: str, edge: str) -> None:
    labels = {"role": role, "edge": edge}
    assert one_value(samples, "rlpipe_groups_processed_total", outcome="ok", **labels) > 0
    count = one_value(samples, "rlpipe_stage_latency_seconds_count", outcome="ok", **labels)
    assert count > 0
    assert 0 < one_value(samples, "rlpipe_stage_latency_seconds_sum", outcome="ok", **labels) < count * 600
    assert one_value(samples, "rlpipe_stage_latency_seconds_bucket", outcome="ok", le="+Inf", **labels) == count
    assert one_value(samples, "rlpipe_consumer_lag", **labels) >= 0
    assert one_value(samples, "rlpipe_dead_letters_total", reason="undecodable", **labels) == 1
    assert one_value(samples, "rlpipe_groups_processed_total", outcome="dead", **labels) == 1


@pytest.mark.timeout(900)
def test_every_service_is_scraped_and_one_group_is_one_trace(tiny_model, tmp_path):
    runs = tmp_path / "runs"
    receiver = OtlpReceiver()
    config = config_file(
        tmp_path,
        tiny_model,
        "obs.yaml",
        run_id="obs",
        train={"total_steps": TOTAL_STEPS, "batch_size": 4, "learning_rate": 2e-5, "max_inflight_batches": 2},
        checkpoint={"save_every_steps": 2, "keep_last": 2},
        rollout={"prompts_per_batch": 4},
        telemetry={"otlp_endpoint": receiver.endpoint, "export_interval_s": 2},
    )
    run_dir = runs / "obs"
    with running_pipeline(config) as process:
        run = wait_for_run_file(run_dir, process)
        asyncio.run(inject_undecodable(run["nats_url"], "obs", operator_options(run_dir)))
        services = run["services"]
        # Every ready event names its endpoint (the trainer's too: current_telemetry().metrics_url).
        missing = [name for name in CONSUMERS if "metrics_url" not in services[name]]
        assert not missing, f"ready events without metrics_url: {missing}"
        targets = {name: (services[name]["metrics_url"], stage_done(*CONSUMERS[name])) for name in STAGES}
        scraped = scrape_until({**targets, "trainer": (services["trainer"]["metrics_url"], trainer_done)})
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    receiver.stop()
    # Each service stopped cleanly, which is when it flushes its last spans; every structured
    # line it logged names the run, the service and the replica.
    for name, (role, _) in CONSUMERS.items():
        lines = (run_dir / "logs" / f"{name}.log").read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]  # the rest is vLLM's own output
        assert events[-1]["event"] == "stopped", (name, events[-3:], output[-3000:])
        for event in events:
            assert event["run_id"] == "obs" and event["service"] == role and event["instance"].startswith(role), event

    for name in STAGES:
        assert_service_basics(scraped[name])
        assert_stage(scraped[name], *CONSUMERS[name])
    rollout = scraped["rollout-0"]
    assert one_value(rollout, "rlpipe_weight_sync_duration_seconds_count") >= 1
    assert 0 < one_value(rollout, "rlpipe_weight_sync_duration_seconds_sum") < 600
    assert one_value(rollout, "rlpipe_weight_sync_bytes_total") > 0
    assert one_value(rollout, "rlpipe_rollout_policy_version") >= 1

    trainer = scraped["trainer"]
    assert_service_basics(trainer)
    for key in TRAINER_GAUGES:
        one_value(trainer, f"rlpipe_trainer_{key}")  # present once, finite
    assert one_value(trainer, "rlpipe_trainer_step") >= 2
    assert one_value(trainer, "rlpipe_checkpoints_total", outcome="ok") >= 1
    assert one_value(trainer, "rlpipe_checkpoints_total", outcome="failed") == 0
    assert 0 < one_value(trainer, "rlpipe_checkpoint_duration_seconds_sum", outcome="ok") < 600
    # Every save's snapshot held the loop for a moment, counted when taken: one may still be uploading when scraped.
    saves = one_value(trainer, "rlpipe_checkpoint_stall_seconds_count")
    assert saves >= one_value(trainer, "rlpipe_checkpoints_total", outcome="ok") >= 1
    assert 0 < one_value(trainer, "rlpipe_checkpoint_stall_seconds_sum") < 600
    assert one_value(trainer, "rlpipe_dead_letters_total", role="trainer", edge=EXPERIENCE, reason="undecodable") == 1

    # OTLP got the same metrics as the endpoints.
    assert {
        "rlpipe_groups_processed",
        "rlpipe_stage_latency",
        "rlpipe_consumer_lag",
        "rlpipe_weight_sync_duration",
        "rlpipe_process_resident_memory",
        "rlpipe_trainer_entropy",
    } <= receiver.metric_names

    # One group, one trace: each service's span is the child of the one before it.
    traces: dict[str, dict[str, list]] = {}
    for span in receiver.spans:
        traces.setdefault(span.trace_id, {}).setdefault(span.name, []).append(span)
    complete = [spans for spans in traces.values() if all(name in spans for name, _ in SPAN_CHAIN)]
    assert complete, (
        f"no trace holds {[name for name, _ in SPAN_CHAIN]}; "
        f"span names seen: {sorted({s.name for s in receiver.spans})}"
    )
    spans = complete[0]
    group_id = spans["rollout.prompts"][0].attributes["rlpipe.group_id"]
    parent = None
    for name, service in SPAN_CHAIN:
        [span] = [s for s in spans[name] if s.attributes.get("rlpipe.outcome", "ok") == "ok"]
        assert span.service == service, (name, span.service)
        assert span.attributes["rlpipe.group_id"] == group_id, (name, span.attributes)
        if parent is not None:
            assert span.parent_span_id == parent.span_id, (name, "is not a child of", parent.name)
        parent = span
