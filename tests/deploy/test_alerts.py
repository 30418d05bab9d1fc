"""Prometheus alert rules mirror default_alert_rules(); the dashboard shows what operations.md names."""

from __future__ import annotations

import json
import re

import pytest

from services.common.config import default_alert_rules
from services.common.observe import instruments
from services.common.observe.metric_types import gauge_name
from services.common.observe.metrics import EXPORTED
from tests.support.deploy import DEPLOY, load_yaml
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

# Step-row metrics are exported as rlpipe_trainer_<metric>; the rules on the trainer's status rows watch other series.
SERIES = {
    "checkpoint_failed": 'rlpipe_checkpoints_total{outcome="failed"}',
    "services_down": 'up{job="rlpipe"}',
    "groups_lost": 'rlpipe_trainer_groups_total{fate="lost"}',
    "roles_stalled": "rlpipe_stage_stalled",
    "role_restarts": "rlpipe_service_starts",
    "disk_free_saves": "rlpipe_disk_free_saves",
}
# Rules whose window is not counted in steps: restarts count over supervision.restart_window_s (1 h by default).
WINDOWS = {"restart_loop": "1h"}
COMPARATOR = {"above": ">", "below": "<"}
METRIC = re.compile(r"\brlpipe_[a-z_]*[a-z]\b")


def series(metric: str) -> str:
    return SERIES.get(metric, gauge_name(metric))


def exported() -> set[str]:
    """The series the services export, as services/common/observe/instruments.py documents and defines them."""
    return set(METRIC.findall(instruments.__doc__)) | {metric.gauge_name for metric in EXPORTED}


@pytest.fixture(scope="module")
def alerts() -> dict[str, dict]:
    rules = [rule for group in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"] for rule in group["rules"]]
    mirrored = [rule for rule in rules if "rule" in rule["labels"]]
    names = [rule["labels"]["rule"] for rule in mirrored]
    assert len(names) == len(set(names))
    return {rule["labels"]["rule"]: rule for rule in mirrored}


def test_one_prometheus_alert_per_default_rule(alerts):
    assert set(alerts) == {rule.name for rule in default_alert_rules()}


@pytest.mark.parametrize("rule", default_alert_rules(), ids=lambda rule: rule.name)
def test_alert_mirrors_the_rule(rule, alerts):
    alert = alerts[rule.name]
    expr = alert["expr"]
    assert alert["labels"]["severity"] == rule.severity
    assert [a.strip() for a in alert["annotations"]["actions"].split(",")] == rule.actions
    window = WINDOWS.get(rule.name, f"{rule.window_steps}m")
    if rule.condition != "nan":
        assert series(rule.metric) in expr
    if rule.condition == "nan":
        # The exporter drops a NaN or infinite value and counts it instead.
        assert expr == f'increase(rlpipe_trainer_nonfinite_metrics_total{{metric="{rule.metric}"}}[{window}]) > 0'
        return
    # A window of N steps is N minutes: in the range selector, or as `for` where the expression has none.
    assert rule.condition == "absent" or f"[{window}]" in expr or alert.get("for") == window
    if rule.condition in COMPARATOR:
        comparison = re.search(r"([<>])\s*([-+0-9.eE]+)\s*$", expr)
        assert comparison, expr
        assert (comparison.group(1), float(comparison.group(2))) == (COMPARATOR[rule.condition], rule.threshold)
        if rule.metric not in SERIES:
            # Every value of the window beyond the threshold: its max below, or its min above.
            extreme = "max_over_time" if rule.condition == "below" else "min_over_time"
            assert expr.startswith(f"{extreme}({series(rule.metric)}[{window}])")
    elif rule.condition == "absent":
        # No new value of the gauge within window_s: it did not change over that range.
        assert expr == f"changes({series(rule.metric)}[{rule.window_s / 60:g}m]) == 0"
    elif rule.condition == "rises_by":
        factor = 1 + rule.threshold
        recent, earlier = (
            f"avg_over_time({series(rule.metric)}[{window}])",
            f"avg_over_time({series(rule.metric)}[{window}] offset {window})",
        )
        assert re.fullmatch(rf"{re.escape(recent)} > ([0-9.]+) \* {re.escape(earlier)}", expr), expr
        assert float(re.search(r"> ([0-9.]+) \*", expr).group(1)) == factor
    else:
        pytest.fail(f"no Prometheus form for condition {rule.condition!r} yet")


def test_prometheus_scrapes_every_role_as_job_rlpipe():
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "rlpipe"
    (discovery,) = job["dns_sd_configs"]
    assert sorted(discovery["names"]) == ["reference", "reward", "rollout", "trainer"]
    compose_env = load_yaml(DEPLOY / "compose.yaml")["x-rlpipe-env"]
    assert discovery["port"] == int(compose_env["RLPIPE_TELEMETRY__METRICS_PORT"])
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]


def test_dashboard_shows_the_training_and_pipeline_signals():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "rlpipe.json").read_text())
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    for metric in (
        "rlpipe_trainer_entropy",
        "rlpipe_trainer_reward_mean",
        "rlpipe_trainer_reward_std",
        "rlpipe_trainer_kl_ref",
        "rlpipe_trainer_response_length_mean",
        "rlpipe_trainer_termination_rate",
        "rlpipe_trainer_step_time_s",
        "rlpipe_consumer_lag",
        "rlpipe_dead_letters_total",
        "rlpipe_gpu_utilization_percent",
        "rlpipe_gpu_memory_used_bytes",
        "rlpipe_gpu_memory_total_bytes",
    ):
        assert re.search(rf"\b{metric}\b", exprs), metric
    datasource = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert {t["datasource"]["uid"] for panel in dashboard["panels"] for t in panel["targets"]} == {datasource["uid"]}
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "rlpipe.yml")["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_each_role_gpu_is_alerted_on_per_role_replica_and_gpu_for_headroom_and_low_utilisation():
    groups = {group["name"]: group["rules"] for group in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"]}
    alerts = {rule["alert"]: rule for rule in groups["rlpipe-gpu"]}
    assert set(alerts) == {"RlpipeRoleGpuMemoryHeadroom", "RlpipeRoleGpuUtilizationLow"}
    headroom, idle = alerts["RlpipeRoleGpuMemoryHeadroom"], alerts["RlpipeRoleGpuUtilizationLow"]
    # The same bound as the trainer's own gpu_memory_headroom rule, over the GPU series every role exports.
    (trainer_rule,) = [rule for rule in default_alert_rules() if rule.name == "gpu_memory_headroom"]
    assert headroom["expr"] == (
        "min by (role, instance, gpu) (1 - rlpipe_gpu_memory_used_bytes / rlpipe_gpu_memory_total_bytes)"
        f" < {trainer_rule.threshold:g}"
    )
    assert headroom["for"] == f"{trainer_rule.window_steps}m"
    assert idle["expr"] == "max by (role, instance, gpu) (avg_over_time(rlpipe_gpu_utilization_percent[30m])) < 10"
    for alert in alerts.values():
        assert alert["labels"] == {"severity": "warning"}  # Prometheus-only: no trainer rule mirrors it
        assert all(f"{{{{ $labels.{label} }}}}" in alert["annotations"]["summary"] for label in ("role", "gpu"))
    # Each series named is one a role exports.
    for alert in alerts.values():
        assert set(METRIC.findall(alert["expr"])) <= exported()


def test_deploy_files_and_the_operations_guide_name_only_exported_metrics():
    texts = {
        "alerts.yml": (DEPLOY / "prometheus" / "alerts.yml").read_text(),
        "rlpipe.json": (DEPLOY / "grafana" / "dashboards" / "rlpipe.json").read_text(),
        "operations.md": (ROOT / "docs" / "operations.md").read_text(),
    }
    known = exported()
    assert {"rlpipe_consumer_lag", "rlpipe_dead_letters_total", "rlpipe_trainer_entropy"} <= known
    # Histograms are scraped as <name>_bucket, _sum and _count.
    unknown = {
        f"{name}: {metric}"
        for name, text in texts.items()
        for metric in METRIC.findall(text)
        if metric not in known and re.sub(r"_(bucket|sum|count)$", "", metric) not in known
    }
    assert unknown == set()


def test_each_roles_network_is_alerted_on_against_its_link_and_weight_sync_against_the_pace_of_versions():
    groups = {group["name"]: group["rules"] for group in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"]}
    alerts = {rule["alert"]: rule for rule in groups["rlpipe-network"]}
    assert set(alerts) == {"RlpipeRoleLinkSaturated", "RlpipeWeightSyncBehindVersions"}
    link = alerts["RlpipeRoleLinkSaturated"]
    # The same bound as the trainer's own network_saturated rule, over every role's counter.
    (trainer_rule,) = [rule for rule in default_alert_rules() if rule.name == "network_saturated"]
    assert link["expr"] == (
        "sum by (role, instance, direction) (rate(rlpipe_network_bytes_total[5m])) > on (role, instance) "
        f"group_left () ({trainer_rule.threshold:g} * max by (role, instance) (rlpipe_network_link_bytes_per_second))"
    )
    assert link["for"] == f"{trainer_rule.window_steps}m"
    behind = alerts["RlpipeWeightSyncBehindVersions"]["expr"]
    assert "rlpipe_weight_sync_duration_seconds_sum" in behind and "delta(rlpipe_trainer_step[15m])" in behind
    for alert in alerts.values():
        assert alert["labels"] == {"severity": "warning"}  # Prometheus-only: the trainer's rule is the row's
        assert (
            set(METRIC.findall(alert["expr"]))
            - {"rlpipe_weight_sync_duration_seconds_sum", "rlpipe_weight_sync_duration_seconds_count"}
            <= exported()
        )
