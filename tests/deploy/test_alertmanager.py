"""Alerts reach a person out of the box: compose's monitoring profile and the k8s base route Prometheus's
firings through Alertmanager to the one webhook setting the trainer uses too, with a dead-man heartbeat."""

from __future__ import annotations

import pytest

from tests.support.deploy import DEPLOY, load_yaml, one, trainer

pytestmark = pytest.mark.unit

WEBHOOK_SETTING = "RLPIPE_ALERTS__WEBHOOK_URL"


def watchdog_route(routes: list[dict], matcher_of) -> dict:
    (route,) = [r for r in routes if matcher_of(r) == "RlpipeWatchdog"]
    return route


def test_prometheus_always_fires_a_watchdog_alert():
    groups = load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"]
    (watchdog,) = [rule for group in groups for rule in group["rules"] if rule["alert"] == "RlpipeWatchdog"]
    assert watchdog["expr"] == "vector(1)" and "for" not in watchdog


def test_compose_prometheus_sends_to_the_monitoring_profiles_alertmanager():
    compose = load_yaml(DEPLOY / "compose.yaml")
    alertmanager = compose["services"]["alertmanager"]
    assert alertmanager["profiles"] == ["monitoring"]
    assert "./alertmanager/alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro" in alertmanager["volumes"]
    prometheus = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    (target,) = prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert target == "alertmanager:9093"
    # The one setting, from deploy/.env, written where the receiver's url_file reads it.
    config = load_yaml(DEPLOY / "alertmanager" / "alertmanager.yml")
    (receiver,) = config["receivers"]
    (webhook,) = receiver["webhook_configs"]
    assert alertmanager["env_file"] == [{"path": ".env", "required": False}]
    script = alertmanager["entrypoint"][-1]
    assert f"$${{{WEBHOOK_SETTING}:?" in script and f"> {webhook['url_file']}" in script
    assert f"# {WEBHOOK_SETTING}=" in (DEPLOY / ".env.example").read_text()  # the one override this profile needs


def test_compose_alertmanager_routes_everything_to_the_webhook_and_the_watchdog_every_five_minutes():
    config = load_yaml(DEPLOY / "alertmanager" / "alertmanager.yml")
    route = config["route"]
    assert route["receiver"] == "webhook" and [r["name"] for r in config["receivers"]] == ["webhook"]
    watchdog = watchdog_route(route["routes"], lambda r: r["matchers"][0].split("=")[1].strip('"'))
    assert watchdog["receiver"] == "webhook" and watchdog["repeat_interval"] == "5m"


@pytest.mark.integration
def test_k8s_routes_the_rules_to_the_webhook_from_the_trainers_secret(rendered):
    for docs in rendered.values():
        config = one(docs, "AlertmanagerConfig", "rlpipe")
        (receiver,) = config["spec"]["receivers"]
        (webhook,) = receiver["webhookConfigs"]
        assert webhook["urlSecret"] == {"name": "rlpipe-secrets", "key": WEBHOOK_SETTING}
        # The trainer reads the same Secret as its environment: RLPIPE_ALERTS__WEBHOOK_URL is its alerts.webhook_url.
        (container,) = [c for c in trainer(docs)["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
        assert {"secretRef": {"name": "rlpipe-secrets"}} in container["envFrom"]
        route = config["spec"]["route"]
        assert route["receiver"] == "webhook"
        watchdog = watchdog_route(route["routes"], lambda r: r["matchers"][0]["value"])
        assert watchdog["repeatInterval"] == "5m"
