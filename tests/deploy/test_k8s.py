"""deploy/k8s: both overlays render with kustomize, validate against the Kubernetes schemas, and
wire the roles the way the bus and config expect (consumers, streams, ports, probes, secrets)."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from services.common.transport.streams import WORK_QUEUES, stream_name
from tests.support.deploy import (
    ADMIN_PORT,
    DEPLOY,
    HEALTH_PORT,
    KUBERNETES_VERSION,
    METRICS_PORT,
    OVERLAYS,
    TRAINER_PORT,
    container,
    env_map,
    find,
    load_yaml,
    one,
    trainer,
)

pytestmark = pytest.mark.integration

# Custom resources have no schema in kubernetes-validate; their shape is checked below.
CUSTOM_KINDS = {
    "ScaledObject",
    "PrometheusRule",
    "PodMonitor",
    "AlertmanagerConfig",
    "Certificate",
    "Issuer",
    "LocalQueue",
    "ClusterQueue",
    "ResourceFlavor",
}
STATELESS = {role: edge for edge, role in WORK_QUEUES.items()}  # role -> the edge it consumes


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_resources_match_the_kubernetes_schemas(overlay, rendered):
    errors = []
    for doc in rendered[overlay]:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, error.path))}: {error.message}")
    assert errors == []


def test_schema_validation_rejects_an_unknown_field(rendered):
    deployment = copy.deepcopy(one(rendered["prod"], "Deployment", "reward"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = HEALTH_PORT
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_only_the_expected_kinds_are_rendered(rendered):
    kinds = {doc["kind"] for doc in rendered["prod"]}
    assert kinds == {
        "Namespace",
        "PriorityClass",
        "ConfigMap",
        "Service",
        "StatefulSet",
        "Deployment",
        "Job",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Role",
        "RoleBinding",
        "ScaledObject",
        "PrometheusRule",
        "PodMonitor",
        "AlertmanagerConfig",
        "Certificate",
        "Issuer",
    }
    assert {doc["kind"] for doc in rendered["dev"]} == kinds - {"PriorityClass"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_lands_in_the_overlay_namespace(overlay, rendered):
    (namespace,) = find(rendered[overlay], "Namespace")
    name = namespace["metadata"]["name"]
    cluster_wide = {"Namespace", "PriorityClass"}
    assert {doc["metadata"].get("namespace") for doc in rendered[overlay] if doc["kind"] not in cluster_wide} == {name}
    assert not find(rendered[overlay], "ConfigMap", "rlpipe-run"), "components/run's input is local-config"


def config_probe(role: str) -> dict:
    """The exec probe of a role whose port carries weights (TLS with weight_sync.tls_*; the kubelet's grpc probe
    speaks plaintext only): port and TLS from the run's config."""
    command = f'exec python -m services.cli.healthcheck --config "/etc/rlpipe/${{RLPIPE_ENV}}.yaml" --role {role}'
    return {"command": ["sh", "-c", command]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_stateless_role_is_a_deployment_probed_over_grpc(overlay, rendered):
    for role in STATELESS:
        deployment = one(rendered[overlay], "Deployment", role)
        spec = container(deployment)
        assert "replicas" not in deployment["spec"], "KEDA owns the replica count"
        assert spec["args"] == ["python", "-m", f"services.{role}", "--config", "/etc/rlpipe/$(RLPIPE_ENV).yaml"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if role == "rollout":  # its port carries the weight relay
                assert spec[probe] == {**spec[probe], "exec": config_probe(role)} and "grpc" not in spec[probe]
            else:
                assert spec[probe]["grpc"] == {"port": HEALTH_PORT}, (role, probe)
        assert {p["containerPort"] for p in spec["ports"]} == {HEALTH_PORT, METRICS_PORT}
    assert int(env_map(rendered[overlay])["RLPIPE_SERVICE__GRPC_PORT"]) == HEALTH_PORT
    assert int(env_map(rendered[overlay])["RLPIPE_TELEMETRY__METRICS_PORT"]) == METRICS_PORT


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_get_config_env_secrets_and_their_name(overlay, rendered):
    docs = rendered[overlay]
    config_maps = {cm["metadata"]["name"]: cm for cm in find(docs, "ConfigMap")}
    workloads = [*(one(docs, "Deployment", role) for role in STATELESS), trainer(docs)]
    for workload in workloads:
        spec = container(workload)
        sources = spec["envFrom"]
        assert sources[0]["configMapRef"]["name"] in config_maps
        assert sources[1] == {"secretRef": {"name": "rlpipe-secrets"}}
        # The role's own store user, last so that it wins over store keys rlpipe-secrets may still carry.
        assert sources[2:] == [{"secretRef": {"name": f"rlpipe-store-{workload['metadata']['name']}"}}]
        assert {"name": "RLPIPE_SERVICE__INSTANCE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in spec[
            "env"
        ]
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        config = config_maps[volumes["config"]["configMap"]["name"]]
        # The pod reads /etc/rlpipe/$(RLPIPE_ENV).yaml: the key must be there.
        assert f"{env_map(docs)['RLPIPE_ENV']}.yaml" in config["data"]
        assert {"name": "config", "mountPath": "/etc/rlpipe", "readOnly": True} in spec["volumeMounts"]
        assert workload["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_configs_in_the_config_map_are_the_files_in_deploy_config(rendered):
    (config,) = [cm for cm in find(rendered["prod"], "ConfigMap") if cm["metadata"]["name"].startswith("rlpipe-config")]
    for name, text in config["data"].items():
        assert text == (DEPLOY / "config" / name).read_text(), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stateless_roles_scale_on_their_consumer_lag(overlay, rendered):
    docs = rendered[overlay]
    namespace = find(docs, "Namespace")[0]["metadata"]["name"]
    run_id = env_map(docs)["RLPIPE_RUN_ID"]  # the pods' run id (it overrides the config file's): components/run
    for role, edge in STATELESS.items():
        scaled = one(docs, "ScaledObject", role)
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        assert scaled["spec"]["scaleTargetRef"] == {"name": role}
        # Zero when a run has ended (test_stateless_roles_scale_to_zero_once_the_run_has_ended).
        assert 0 == scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
        trigger = scaled["spec"]["triggers"][0]
        assert trigger["type"] == "nats-jetstream"
        meta = trigger["metadata"]
        assert set(meta) == {
            "natsServerMonitoringEndpoint",
            "account",
            "stream",
            "consumer",
            "lagThreshold",
            "useHttps",
            "activationLagThreshold",
        }
        assert meta["natsServerMonitoringEndpoint"] == f"nats-headless.{namespace}.svc.cluster.local:8222"
        assert meta["account"] == "$G"
        assert (meta["stream"], meta["consumer"]) == (stream_name(run_id, edge), role)
        assert int(meta["lagThreshold"]) > 0
        assert all(isinstance(value, str) for value in meta.values()), "KEDA metadata values are strings"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stateless_roles_scale_to_zero_once_the_run_has_ended(overlay, rendered):
    docs = rendered[overlay]
    namespace = find(docs, "Namespace")[0]["metadata"]["name"]
    for role in STATELESS:
        scaled = one(docs, "ScaledObject", role)["spec"]
        assert scaled["minReplicaCount"] == 0 and scaled["cooldownPeriod"] == 300, role
        lag, training = scaled["triggers"]
        # Woken by the first message waiting; kept while messages wait or the trainer applied groups in 5 minutes.
        assert lag["metadata"]["activationLagThreshold"] == "0", role
        assert training["type"] == "prometheus"
        query = f'sum(rate(rlpipe_trainer_groups_total{{namespace="{namespace}"}}[5m]))'
        assert training["metadata"]["query"] == query, role
        assert training["metadata"]["activationThreshold"] == "0"
        assert float(training["metadata"]["threshold"]) >= 1e6  # one replica at most from this trigger
    assert "rlpipe_trainer_groups_total" in (DEPLOY / "prometheus" / "alerts.yml").read_text()  # a real series


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_cover_the_scaled_roles_and_nats(overlay, rendered):
    docs = rendered[overlay]
    for name in [*STATELESS, "nats"]:
        budget = one(docs, "PodDisruptionBudget", name)
        assert budget["spec"]["maxUnavailable"] == 1
        assert budget["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": name}


def test_trainer_is_one_gpu_pod_started_by_torchrun_through_the_wrapper(rendered):
    docs = rendered["prod"]
    job = trainer(docs)
    assert (job["kind"], job["spec"]["parallelism"], job["spec"]["completions"]) == ("Job", 1, 1)
    spec = container(job)
    assert spec["args"][:3] == ["python", "-m", "services.trainer.learning.distributed"]  # torchrun's arguments follow
    assert spec["args"][3:6] == ["--standalone", "--nnodes=1", "--nproc-per-node=$(TRAINER_GPUS)"]
    assert spec["args"][6:] == ["-m", "services.trainer", "--config", "/etc/rlpipe/$(RLPIPE_ENV).yaml"]
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == int(env_map(docs)["TRAINER_GPUS"])
    assert (
        one(docs, "Deployment", "rollout")["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
            "nvidia.com/gpu"
        ]
        == 1
    )
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert spec[probe]["exec"] == config_probe("trainer") and "grpc" not in spec[probe]
    assert {p["name"]: p["containerPort"] for p in spec["ports"]} == {
        "weights": TRAINER_PORT,
        "admin": ADMIN_PORT,
        "metrics": METRICS_PORT,
    }
    assert env_map(docs)["RLPIPE_SERVICE__TRAINER_HOST"] == one(docs, "Service", "trainer")["metadata"]["name"]
    assert one(docs, "Service", "trainer-admin")["spec"]["ports"] == [
        {"name": "admin", "port": ADMIN_PORT, "targetPort": "admin"}
    ]


def test_dev_runs_without_gpus_and_builds_the_tiny_model(rendered):
    docs = rendered["dev"]
    for workload in find(docs, "Deployment") + find(docs, "StatefulSet"):
        assert "nvidia.com/gpu" not in container(workload)["resources"].get("limits", {}), workload["metadata"]["name"]
    assert env_map(docs)["RLPIPE_ROLLOUT__BACKEND"] == "hf"
    job = one(docs, "Job", "model-init")
    assert (
        "rlpipe build-tiny --out /assets/models/tiny-arith --data /assets/data/arith --seed 0"
        in container(job)["args"][-1]
    )


def test_prod_runs_the_reference_on_a_gpu_from_the_cuda_image(rendered):
    reference = container(one(rendered["prod"], "Deployment", "reference"))
    assert reference["image"] == "rlpipe/reference-gpu:0.1.0"
    assert reference["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container(one(rendered["dev"], "Deployment", "reference"))["image"] == "rlpipe/reference:dev"


def test_nats_is_a_three_node_jetstream_cluster(rendered):
    docs = rendered["prod"]
    nats = one(docs, "StatefulSet", "nats")
    assert nats["spec"]["replicas"] == 3
    config_map = next(cm for cm in find(docs, "ConfigMap") if cm["metadata"]["name"].startswith("nats-config"))
    conf = config_map["data"]["nats.conf"]
    assert conf == (DEPLOY / "k8s" / "base" / "nats" / "nats.conf").read_text()
    for node in range(3):
        assert f"nats://nats-{node}.{nats['spec']['serviceName']}:6222" in conf
    headless = one(docs, "Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    probe = container(nats)["readinessProbe"]["httpGet"]
    assert probe["path"] == "/healthz?js-enabled-only=true"
    assert env_map(docs)["RLPIPE_NATS__URL"] == "tls://nats:4222"


def ingress_rules(docs: list[dict]) -> list[tuple[dict, dict]]:
    return [(policy, rule) for policy in find(docs, "NetworkPolicy") for rule in policy["spec"].get("ingress", [])]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_opens_only_the_admin_port_to_other_namespaces(overlay, rendered):
    docs = rendered[overlay]
    assert any(
        p["spec"]["podSelector"] == {} and p["spec"]["policyTypes"] == ["Ingress"] for p in find(docs, "NetworkPolicy")
    )
    # Platform exceptions, each one port from one named namespace (documented in networkpolicy.yaml).
    platform = {("keda", 8222), ("monitoring", METRICS_PORT)}
    operators = {"matchLabels": {"rlpipe.dev/admin-access": "true"}}
    open_to_all, from_platform, from_operators = [], set(), []
    for policy, rule in ingress_rules(docs):
        sources = rule.get("from")
        ports = [p["port"] for p in rule.get("ports", [])]
        if sources == [{"podSelector": {}}]:
            assert not ports, "same-namespace traffic is allowed on every port"
        elif sources is None:
            open_to_all.append((policy["spec"]["podSelector"], ports))
        elif sources == [{"namespaceSelector": operators, "podSelector": operators}]:
            from_operators.append((policy["spec"]["podSelector"], ports))
        else:
            (source,) = sources
            assert set(source) == {"namespaceSelector"}, policy["metadata"]["name"]
            (port,) = ports
            from_platform.add((source["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"], port))
    assert open_to_all == []
    # The admin port, from the operators' labelled pods in their labelled namespace only.
    assert from_operators == [({"matchLabels": {"app.kubernetes.io/name": "trainer"}}, [ADMIN_PORT])]
    assert from_platform == platform


def test_alert_rules_and_monitoring_resources(rendered):
    docs = rendered["prod"]
    rule = one(docs, "PrometheusRule", "rlpipe")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"]
    monitor = one(docs, "PodMonitor", "rlpipe")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "rlpipe"}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    for role in STATELESS:
        labels = one(docs, "Deployment", role)["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "rlpipe"
    dashboard = one(docs, "ConfigMap", "rlpipe-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["rlpipe.json"] == (DEPLOY / "grafana" / "dashboards" / "rlpipe.json").read_text()
