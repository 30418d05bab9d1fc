"""The Grafana dashboard against a live run: every metric its queries name is exported by some role, and each role's
network counters move while it trains.

The run is the tiny model's `rlpipe run`, open-ended (its steps are never all taken): each role's Prometheus endpoint
(from run.json) is scraped once the pipeline has trained a few steps and synced weights, and again after more of
both; then the run is stopped as a supervisor would. The dashboard's PromQL is parsed for the metric names it reads
(``metric_names``); a name no role exports fails the test unless ``EXPECTED_ABSENT`` says which setups export it.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable

import pytest
from prometheus_client.samples import Sample

from services.common.observe import instruments
from services.common.observe import metrics as m
from tests.support.paths import ROOT
from tests.support.runs import config_file, metric_rows, run_info, running_pipeline
from tests.support.telemetry import scrape, values

pytestmark = pytest.mark.e2e

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "rlpipe.json"
ROLES = ("trainer", "rollout-0", "reward-0", "reference-0")
NO_GPU = "read from NVML at each scrape: only a role whose process sees a GPU exports it, and this machine has none"
# Metrics the dashboard may name that only some setups export, and why this run does not.
EXPECTED_ABSENT = {
    "rlpipe_gpu_utilization_percent": NO_GPU,
    "rlpipe_gpu_memory_used_bytes": NO_GPU,
    "rlpipe_gpu_memory_total_bytes": NO_GPU,
    "rlpipe_reward_http_latency_seconds_bucket": "only a reward role with reward.http (a remote reward service)",
    "rlpipe_reward_http_errors_total": "only a reward role with reward.http, after a failed request",
    "rlpipe_reward_http_breaker_state": "only a reward role with reward.http (a remote reward service)",
    "rlpipe_rollout_env_http_latency_seconds_bucket": "only a rollout with rollout.environment_url",
    "rlpipe_rollout_env_http_errors_total": "only a rollout with rollout.environment_url, after a failed request",
    "rlpipe_rollout_env_http_breaker_state": "only a rollout with rollout.environment_url",
}
# PromQL's aggregations, functions and keywords (a word followed by "(" is a call whatever it is).
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?[a-z]*|[A-Za-z_:][A-Za-z0-9_:]*|\S')


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers that are no call, keyword, label or duration.

    Label matchers (``{...}``), range selectors (``[5m]``) and the label lists of ``by``, ``on`` and the like are
    left out before the identifiers are read; strings and numbers (durations included) are tokens of their own."""
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    tokens = TOKEN.findall(expr)
    return {
        token
        for token, following in zip(tokens, [*tokens[1:], ""], strict=True)
        if re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", token) and following != "(" and token not in KEYWORDS
    }


def dashboard_metrics() -> set[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {name for panel in panels for target in panel["targets"] for name in metric_names(target["expr"])}


def unaccounted(named: set[str], exported: set[str]) -> set[str]:
    """What the dashboard names that no role exported and ``EXPECTED_ABSENT`` does not explain."""
    return named - exported - EXPECTED_ABSENT.keys()


def total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(values(samples, name, **labels))


def scrape_all(urls: dict[str, str], done: Callable[[dict[str, list[Sample]]], bool], timeout: float = 300):
    """Every role scraped again until ``done(scrapes)`` holds; the last scrapes either way (the asserts say what
    is missing)."""
    deadline = time.monotonic() + timeout
    while True:
        scrapes = {name: scrape(url) for name, url in urls.items()}
        if done(scrapes) or time.monotonic() > deadline:
            return scrapes
        time.sleep(0.5)


def progressed(steps: float, syncs: float) -> Callable[[dict[str, list[Sample]]], bool]:
    """The trainer past ``steps`` steps and the rollout past ``syncs`` weight syncs."""
    return lambda scrapes: (
        total(scrapes["trainer"], "rlpipe_trainer_step") > steps
        and total(scrapes["rollout-0"], "rlpipe_weight_sync_duration_seconds_count") > syncs
    )


@pytest.mark.timeout(900)
def test_every_metric_the_dashboard_queries_is_exported_and_each_roles_network_counters_move(tiny_model, tmp_path):
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        "dash.yaml",
        run_id="dash",
        train={"total_steps": 500, "batch_size": 4, "learning_rate": 2e-5, "max_inflight_batches": 2},
        checkpoint={"save_every_steps": 0},
        rollout={"prompts_per_batch": 4},
        telemetry={"link_mib_s": 100.0},
    )
    run_dir = runs / "dash"
    with running_pipeline(config) as process:
        services = run_info(run_dir, process)["services"]
        urls = {name: services[name]["metrics_url"] for name in ROLES}
        first = scrape_all(urls, progressed(steps=2, syncs=0))
        steps = total(first["trainer"], "rlpipe_trainer_step")
        syncs = total(first["rollout-0"], "rlpipe_weight_sync_duration_seconds_count")
        second = scrape_all(urls, progressed(steps=steps + 1, syncs=syncs))
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    assert total(second["trainer"], "rlpipe_trainer_step") > steps, output[-3000:]
    assert total(second["rollout-0"], "rlpipe_weight_sync_duration_seconds_count") > syncs, output[-3000:]

    exported = {sample.name for samples in second.values() for sample in samples}
    named = dashboard_metrics()
    assert {"rlpipe_network_bytes_total", "rlpipe_trainer_entropy", "rlpipe_consumer_lag"} <= named
    assert unaccounted(named, exported) == set(), f"named by the dashboard, exported by no role: {named - exported}"
    # Each exception is a metric rlpipe does export somewhere (instruments.py says where), not a stale name.
    documented = set(re.findall(r"\brlpipe_[a-z_]*[a-z]\b", instruments.__doc__ or ""))
    assert {re.sub(r"_(bucket|sum|count)$", "", name) for name in EXPECTED_ABSENT} <= documented

    # Every role moved bytes both ways over the bus between the two scrapes; the trainer served weights and the
    # rollout pulled them.
    name = "rlpipe_network_bytes_total"
    role_of = {"trainer": "trainer", "rollout-0": "rollout", "reward-0": "reward", "reference-0": "reference"}
    for service, role in role_of.items():
        for direction in ("in", "out"):
            before = total(first[service], name, role=role, channel="bus", direction=direction)
            after = total(second[service], name, role=role, channel="bus", direction=direction)
            assert after > before > 0, (service, direction, before, after)
    served = [
        total(s["trainer"], name, role="trainer", channel="weight_sync", direction="out") for s in (first, second)
    ]
    pulled = [
        total(s["rollout-0"], name, role="rollout", channel="weight_sync", direction="in") for s in (first, second)
    ]
    assert served[1] > served[0] > 0 and pulled[1] > pulled[0] > 0, (served, pulled)
    link = values(second["trainer"], "rlpipe_network_link_bytes_per_second", role="trainer")
    assert link == [100.0 * 2**20]

    # The trainer's step rows carry its rates, and its share of the 100 MiB/s link.
    rows = [row for row in metric_rows(run_dir) if m.NETWORK_BUS_IN in row]
    assert rows and any(row[m.NETWORK_BUS_IN] > 0 for row in rows)
    assert any(row[m.NETWORK_WEIGHT_SYNC_OUT] > 0 for row in rows)
    assert all(0 <= row[m.NETWORK_LINK_USE] < 1 for row in rows)


@pytest.mark.unit
def test_the_promql_reader_finds_each_metric_and_nothing_else():
    assert metric_names(
        'sum by (role, edge) (increase(rlpipe_dead_letters_total{reason="undecodable"}[5m])) / on (role) '
        "group_left () max by (role) (rlpipe_network_link_bytes_per_second offset 10m) > bool 0.8 * 1e3"
    ) == {"rlpipe_dead_letters_total", "rlpipe_network_link_bytes_per_second"}
    assert metric_names("rlpipe_trainer_entropy") == {"rlpipe_trainer_entropy"}


@pytest.mark.unit
def test_a_dashboard_metric_nobody_exports_is_caught_unless_its_absence_is_explained():
    named = dashboard_metrics() | {"rlpipe_trainer_entropi"}  # a typo planted in a query
    exported = named - {"rlpipe_trainer_entropi", "rlpipe_gpu_utilization_percent"}
    assert unaccounted(named, exported) == {"rlpipe_trainer_entropi"}


@pytest.mark.unit
def test_the_dead_letter_series_every_stage_starts_at_zero_are_every_reason_a_stage_can_give():
    from services.common.transport.settle import DeadCause

    assert set(instruments.DEAD_LETTER_REASONS) == {cause.value for cause in DeadCause}
