"""deploy/k8s for the people who run it: what is encrypted and closed by default (WeightSync TLS, egress, the admin
allowlist, no model hub, an ingress example), the GPUs a finished run gives back (the trainer Job, scale to zero,
priority and placement), several runs on one cluster (names per run, a queue), and who may do what (RBAC)."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.config import AdminConfig
from services.common.service import EXIT_REFUSED
from services.common.transport.streams import WORK_QUEUES, stream_name
from tests.support.deploy import (
    ADMIN_PORT,
    DEPLOY,
    OVERLAYS,
    container,
    env_map,
    find,
    kubectl,
    load_yaml,
    mounted_files,
    one,
    render_with_component,
    trainer,
)
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration

STATELESS = set(WORK_QUEUES.values())
GPU_ROLES = ("trainer", "rollout", "reference")
PLACEHOLDER_NETWORK = "192.0.2.0/24"  # the base's store address, which reaches nothing: every overlay sets its own


def render(path: Path) -> list[dict]:
    done = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def second_run() -> list[dict]:
    return render(DEPLOY / "k8s" / "runs" / "example")


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def env_of(workload: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(workload)["env"]}


# -- encrypted and closed by default ---------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_weight_sync_speaks_tls_with_a_certificate_of_its_own_that_the_rollouts_check(overlay, rendered):
    docs = rendered[overlay]
    secrets = "/run/rlpipe/secrets"
    for workload in (trainer(docs), one(docs, "Deployment", "rollout")):
        env = env_of(workload)
        assert (env["RLPIPE_WEIGHT_SYNC__TLS_CERT"], env["RLPIPE_WEIGHT_SYNC__TLS_KEY"]) == (
            f"{secrets}/weights.pem",
            f"{secrets}/weights.key",
        )
        files = mounted_files(pod_spec(workload), "secrets")
        assert (files["weights.pem"], files["weights.key"]) == (
            ("weightsync-tls", "tls.crt"),
            ("weightsync-tls", "tls.key"),
        )
    # The rollouts check the trainer's certificate (and their peers') against the namespace's CA, under "trainer".
    rollout = one(docs, "Deployment", "rollout")
    assert env_of(rollout)["RLPIPE_WEIGHT_SYNC__TLS_CA"] == f"{secrets}/ca.pem"
    assert mounted_files(pod_spec(rollout), "secrets")["ca.pem"] == ("nats-tls", "ca.crt")
    spec = one(docs, "Certificate", "weightsync-tls")["spec"]
    assert spec["issuerRef"]["name"] == one(docs, "Certificate", "nats-tls")["spec"]["issuerRef"]["name"]
    assert env_map(docs)["RLPIPE_SERVICE__TRAINER_HOST"] in spec["dnsNames"]
    assert "127.0.0.1" in spec["ipAddresses"] and "client auth" not in spec["usages"]  # the probes; not a NATS node
    assert spec["secretName"] != one(docs, "Certificate", "trainer-admin-tls")["spec"]["secretName"]
    for role in ("reward", "reference"):  # they take no weights
        assert "weightsync-tls" not in {
            name for name, _ in mounted_files(pod_spec(one(docs, "Deployment", role)), "secrets").values()
        }


def egress_rules(docs: list[dict], labels: dict[str, str]) -> list[dict]:
    """Every egress rule of every Egress policy that selects a pod with ``labels``."""

    def selects(selector: dict) -> bool:
        matched = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
        for expression in selector.get("matchExpressions", []):
            assert expression["operator"] == "In"
            matched = matched and labels.get(expression["key"]) in expression["values"]
        return matched

    return [
        rule
        for policy in find(docs, "NetworkPolicy")
        if "Egress" in policy["spec"]["policyTypes"] and selects(policy["spec"]["podSelector"])
        for rule in policy["spec"].get("egress", [])
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_reach_only_dns_each_other_and_the_store(overlay, rendered):
    docs = rendered[overlay]
    workloads = [*find(docs, "Deployment"), *find(docs, "StatefulSet"), *find(docs, "Job")]
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        rules = egress_rules(docs, labels)
        name = workload["metadata"]["name"]
        assert rules, f"{name}: no egress policy selects it, so it may reach anything"
        for rule in rules:
            assert rule.get("to"), f"{name}: a rule without destinations allows every address"
            for peer in rule["to"]:
                cidr = peer.get("ipBlock", {}).get("cidr", "")
                assert cidr not in ("0.0.0.0/0", "::/0", PLACEHOLDER_NETWORK), (name, cidr)
        destinations = [peer for rule in rules for peer in rule["to"]]
        assert {"podSelector": {}} in destinations  # this namespace: the bus, WeightSync, the relays
        dns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}
        assert any(peer.items() >= dns.items() for peer in destinations)
    store = one(docs, "NetworkPolicy", "rlpipe-egress-store")["spec"]["egress"]
    if overlay == "dev":  # the MinIO the dev overlay names
        assert "minio.minio.svc" in env_map(docs)["RLPIPE_CHECKPOINT__S3_ENDPOINT"]
        assert store[0]["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "minio"}}}]
    else:
        assert "ipBlock" in store[0]["to"][0]
    # Remote services: none configured by the shipped configs, so none reachable until an overlay adds one.
    assert one(docs, "NetworkPolicy", "rlpipe-egress-remote")["spec"]["egress"] == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_pod_reaches_a_model_hub_and_the_admin_port_admits_private_networks_only(overlay, rendered):
    env = env_map(rendered[overlay])
    assert (env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"]) == ("1", "1")
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert dockerfile.count("HF_HUB_OFFLINE=1") == dockerfile.count("TRANSFORMERS_OFFLINE=1") == 2  # both runtimes
    allowed = AdminConfig(allowed_sources=env["RLPIPE_ADMIN__ALLOWED_SOURCES"]).allowed_sources
    assert allowed and not {"0.0.0.0/0", "::/0"} & set(allowed)
    assert all(re.match(r"^(127|10|172\.16|192\.168)\.", network) for network in allowed)


def test_the_admin_ingress_example_reaches_the_admin_port_over_tls_from_allowed_sources_only(tmp_path):
    docs = render_with_component(tmp_path, "prod", "admin-ingress")
    ingress = one(docs, "Ingress", "trainer-admin")
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPCS"
    assert annotations["nginx.ingress.kubernetes.io/whitelist-source-range"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-ssl-verify"] == "on"
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": "trainer-admin", "port": {"name": "admin"}}
    assert ingress["spec"]["tls"][0]["hosts"] == [rule["host"]]
    policy = one(docs, "NetworkPolicy", "rlpipe-admin-from-ingress")["spec"]
    assert policy["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "trainer"}}
    (allowed,) = policy["ingress"]
    assert allowed["ports"] == [{"protocol": "TCP", "port": ADMIN_PORT}]
    (source,) = allowed["from"]
    assert source["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}


# -- resources released -------------------------------------------------------------------------------------------


def test_the_prod_trainer_is_a_job_that_ends_with_its_run_on_the_base_trainers_pod(rendered):
    job = trainer(rendered["prod"])
    assert job["kind"] == "Job"
    pod = pod_spec(job)
    assert pod["restartPolicy"] == "Never"  # a crash is a new pod (backoffLimit), resuming from its checkpoint
    rules = job["spec"]["podFailurePolicy"]["rules"]
    refused = {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2]}}
    assert refused in rules and EXIT_REFUSED == 2  # a refusal is not retried, as `rlpipe run` does not
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["runs"] == {"name": "runs", "persistentVolumeClaim": {"claimName": "trainer-runs"}}
    assert one(rendered["prod"], "PersistentVolumeClaim", "trainer-runs")["spec"]["accessModes"] == ["ReadWriteOnce"]
    # The same pod as the base's StatefulSet (copied by components/trainer-job): one definition of the trainer.
    base = pod_spec(one(render(DEPLOY / "k8s" / "base"), "StatefulSet", "trainer"))
    for key in ("containers", "initContainers"):
        assert [c["args"] for c in pod[key]] == [c["args"] for c in base[key]], key
        assert [c["env"] for c in pod[key]] == [c["env"] for c in base[key]], key
        assert [c["volumeMounts"] for c in pod[key]] == [c["volumeMounts"] for c in base[key]], key
    assert set(volumes) == {v["name"] for v in base["volumes"]} | {"runs"}
    assert not find(rendered["prod"], "StatefulSet", "trainer")


def test_prod_training_pods_get_their_priority_and_the_gpu_nodes(rendered):
    docs = rendered["prod"]
    (priority,) = find(docs, "PriorityClass")
    assert priority["value"] > 0 and priority["globalDefault"] is False
    for workload in (trainer(docs), one(docs, "Deployment", "rollout"), one(docs, "Deployment", "reference")):
        pod = pod_spec(workload)
        assert pod["priorityClassName"] == priority["metadata"]["name"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert container(workload)["resources"]["limits"]["nvidia.com/gpu"] >= 1
    reward = pod_spec(one(docs, "Deployment", "reward"))
    assert reward["priorityClassName"] == priority["metadata"]["name"] and "nodeSelector" not in reward
    dev = rendered["dev"]  # a dev cluster may have no GPU nodes and no such class
    assert not find(dev, "PriorityClass") and "nodeSelector" not in pod_spec(trainer(dev))


# -- several runs on one cluster ----------------------------------------------------------------------------------


def overlay_namespaces(path: Path) -> tuple[str, str]:
    """The overlay's ``namespace:`` and the namespace it tells components/run (rlpipe-run)."""
    kustomization = load_yaml(path / "kustomization.yaml")
    (told,) = [
        literal.split("=", 1)[1]
        for generator in kustomization["configMapGenerator"]
        if generator["name"] == "rlpipe-run"
        for literal in generator["literals"]
        if literal.startswith("namespace=")
    ]
    return kustomization["namespace"], told


def test_a_second_run_gets_its_own_namespace_streams_and_keda_endpoints_from_two_values(rendered, second_run):
    namespace = find(second_run, "Namespace")[0]["metadata"]["name"]
    run_id = env_map(second_run)["RLPIPE_RUN_ID"]
    assert (namespace, run_id) == ("rlpipe-smol2", "smol2")
    assert {d["metadata"].get("namespace") for d in second_run if d["kind"] not in ("Namespace", "PriorityClass")} == {
        namespace
    }
    for edge, role in WORK_QUEUES.items():
        trigger, training = one(second_run, "ScaledObject", role)["spec"]["triggers"]
        assert trigger["metadata"]["stream"] == stream_name(run_id, edge)
        assert (
            trigger["metadata"]["natsServerMonitoringEndpoint"] == f"nats-headless.{namespace}.svc.cluster.local:8222"
        )
        assert f'namespace="{namespace}"' in training["metadata"]["query"]
    # The first run is untouched: its own names.
    assert one(rendered["prod"], "ScaledObject", "rollout")["spec"]["triggers"][0]["metadata"]["stream"] == (
        stream_name(env_map(rendered["prod"])["RLPIPE_RUN_ID"], "prompts")
    )
    for path in (
        DEPLOY / "k8s" / "overlays" / "dev",
        DEPLOY / "k8s" / "overlays" / "prod",
        DEPLOY / "k8s" / "runs" / "example",
    ):
        stated, told = overlay_namespaces(path)
        assert stated == told, f"{path}: namespace {stated!r} but components/run is told {told!r}"


def test_a_queued_run_waits_in_kueue_and_its_queue_feeds_the_clusters_gpu_queue(second_run):
    job = trainer(second_run)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "rlpipe" and job["spec"]["suspend"] is True
    local = one(second_run, "LocalQueue", "rlpipe")
    cluster = render(DEPLOY / "k8s" / "cluster" / "kueue")
    queue = one(cluster, "ClusterQueue", local["spec"]["clusterQueue"])["spec"]
    (group,) = queue["resourceGroups"]
    assert "nvidia.com/gpu" in group["coveredResources"]
    (flavor_ref,) = group["flavors"]
    flavor = one(cluster, "ResourceFlavor", flavor_ref["name"])["spec"]
    # The flavour's nodes are the ones the prod pods are placed on.
    assert flavor["nodeLabels"] == pod_spec(job)["nodeSelector"]
    assert all("namespace" not in doc["metadata"] for doc in cluster)  # cluster-wide objects
    for role in STATELESS:  # not queued: they wake from zero on the prompts the admitted trainer feeds
        assert one(second_run, "ScaledObject", role)["spec"]["minReplicaCount"] == 0


def test_make_secrets_allows_the_keys_the_subjects_of_the_run_id_it_is_given(tmp_path):
    done = subprocess.run(
        ["sh", str(DEPLOY / "k8s" / "make-secrets.sh"), str(DEPLOY / "config" / "prod.yaml"), "smol2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr
    secrets = {s["metadata"]["name"]: s for s in yaml.safe_load_all(done.stdout)}
    auth = base64.b64decode(secrets["rlpipe-nats-auth"]["data"]["auth.conf"]).decode()
    assert "rlpipe.smol2." in auth and "rlpipe.arith." not in auth
    bad = subprocess.run(
        ["sh", str(DEPLOY / "k8s" / "make-secrets.sh"), str(DEPLOY / "config" / "prod.yaml"), "no.dots"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert bad.returncode != 0 and bad.stdout == "" and "no.dots" in bad.stderr


# -- who may do what ----------------------------------------------------------------------------------------------


def grants(role: dict) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) for every rule of ``role``."""
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


READ = {"get", "list", "watch"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_viewers_read_operators_also_reach_the_admin_api_and_admins_manage_the_deployment(overlay, rendered):
    docs = rendered[overlay]
    viewer, operator, admin = (grants(one(docs, "Role", f"rlpipe-{name}")) for name in ("viewer", "operator", "admin"))
    # Viewer: reads only, never a Secret, never into a pod.
    assert {verb for _, _, verb in viewer} == READ
    assert not {resource for _, resource, _ in viewer} & {"secrets", "pods/exec", "pods/portforward"}
    assert ("", "pods/log", "get") in viewer and ("keda.sh", "scaledobjects", "list") in viewer
    # Operator: the viewer's reads plus exec and port-forward into pods (the Admin API with the trainer's token), and
    # nothing that changes an object.
    assert viewer < operator
    assert operator - viewer == {("", r, v) for r in ("pods/exec", "pods/portforward") for v in ("get", "create")}
    assert not {resource for _, resource, _ in operator} & {"secrets"}
    # Admin: everything rlpipe deploys, Secrets and the trainer Job included; never its own permissions.
    assert (
        ("", "secrets", "*") in admin and ("batch", "jobs", "*") in admin and ("keda.sh", "scaledobjects", "*") in admin
    )
    assert not [g for g, _, _ in admin if g == "rbac.authorization.k8s.io"]
    for name in ("viewer", "operator", "admin"):
        binding = one(docs, "RoleBinding", f"rlpipe-{name}")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"rlpipe-{name}"}
        assert [s["kind"] for s in binding["subjects"]] == ["Group"]


def test_the_operations_guide_says_which_role_may_call_each_admin_method():
    methods = re.findall(r"^\s*rpc (\w+)\(", (ROOT / "proto" / "admin.proto").read_text(), re.MULTILINE)
    guide = (ROOT / "docs" / "operations.md").read_text()
    table = guide[guide.index("| Admin method |") :].split("\n\n", 1)[0]
    rows = {line.split("|")[1].strip().strip("`"): line for line in table.splitlines()[2:]}
    assert set(rows) == set(methods)
    for method, row in rows.items():
        assert "operator" in row and "viewer" not in row.split("|")[3], method
