"""deploy/k8s runs NATS with per-role keys and TLS by default: each role mounts only its own key, the broker
admits nothing else and speaks TLS to clients and between its nodes, only the trainer holds the admin token,
and the trainer runs under rlpipe's torchrun wrapper. The broker config the pods get is run for real, as a
3-node cluster, with the keys deploy/k8s/make-secrets.sh makes."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import kubernetes_validate
import nats
import nkeys
import pytest

from services.common.config import load_config
from services.common.transport.bus import Bus
from services.common.transport.nats_connect import ROLES, SERVICE_ROLES, connect_options
from services.common.transport.streams import stream_name
from tests.support.deploy import (
    KUBERNETES_VERSION,
    OVERLAYS,
    PROD_CONFIG,
    broker_secrets,
    container,
    decoded,
    find,
    load_yaml,
    make_k8s_secrets,
    mounted_files,
    one,
    render_with_component,
    run_make_k8s_secrets,
)
from tests.support.deploy import trainer as trainer_workload
from tests.support.paths import BIN
from tests.support.runs import config_file
from tests.support.servers import free_port

pytestmark = pytest.mark.integration

SECRETS_DIR = "/run/rlpipe/secrets"
STAGES = tuple(role for role in SERVICE_ROLES if role != "trainer")
# Every Secret a pod of the default overlays reads, and which keys of it: the whole Secret is "*".
ROLE_SECRETS = {"rlpipe-secrets": {"*"}, "nats-tls": {"ca.crt"}}
# The trainer's and the rollouts' alone: the run's token, and the certificate of the ports that serve weights.
WEIGHT_SYNC = {"rlpipe-weightsync": {"token"}, "weightsync-tls": {"tls.crt", "tls.key"}}
EXPECTED_SECRETS = {
    "nats": {"rlpipe-nats-auth": {"auth.conf"}, "nats-tls": {"tls.crt", "tls.key", "ca.crt"}},
    "trainer": ROLE_SECRETS
    | WEIGHT_SYNC
    | {
        "rlpipe-nats-trainer": {"nats.nk"},
        "rlpipe-store-trainer": {"*"},
        "trainer-admin-tls": {"tls.crt", "tls.key"},
        "rlpipe-admin": {"token"},
    },
    **{
        role: ROLE_SECRETS
        | (WEIGHT_SYNC if role == "rollout" else {})
        | {f"rlpipe-nats-{role}": {"nats.nk"}, f"rlpipe-store-{role}": {"*"}}
        for role in STAGES
    },
    "model-init": {},
}


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    return {
        doc["metadata"]["name"]: doc["spec"]["template"]["spec"]
        for doc in docs
        if doc["kind"] in ("Deployment", "StatefulSet", "Job")
    }


def secrets_read(pod: dict) -> dict[str, set[str]]:
    """Secret name -> the keys the pod reads of it, from its volumes and its containers' environment."""
    found: dict[str, set[str]] = {}

    def add(name: str, items: list[dict] | None) -> None:
        found.setdefault(name, set()).update({item["key"] for item in items} if items else {"*"})

    for volume in pod.get("volumes", []):
        if "secret" in volume:
            add(volume["secret"]["secretName"], volume["secret"].get("items"))
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                add(source["secret"]["name"], source["secret"].get("items"))
    for spec in pod.get("initContainers", []) + pod["containers"]:
        for source in spec.get("envFrom", []):
            if "secretRef" in source:
                add(source["secretRef"]["name"], None)
        for variable in spec.get("env", []):
            ref = variable.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                add(ref["name"], [{"key": ref["key"]}])
    return found


def env_of(workload: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(workload)["env"]}


def certificate(docs: list[dict], name: str) -> dict:
    found = one(docs, "Certificate", name)
    assert found["apiVersion"] == "cert-manager.io/v1"
    return found["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_reads_only_its_own_roles_secrets(overlay, rendered):
    pods = pod_templates(rendered[overlay])
    expected = {name: secrets for name, secrets in EXPECTED_SECRETS.items() if name in pods}
    assert set(pods) == set(expected)
    assert {name: secrets_read(pod) for name, pod in pods.items()} == expected


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_role_connects_with_its_key_over_tls(overlay, rendered):
    docs = rendered[overlay]
    (env_map,) = [cm for cm in find(docs, "ConfigMap") if cm["metadata"]["name"].startswith("rlpipe-env")]
    url = env_map["data"]["RLPIPE_NATS__URL"]
    assert url == "tls://nats:4222"
    assert "nats" in certificate(docs, "nats-tls")["dnsNames"]  # the host of the URL
    for role in SERVICE_ROLES:
        workload = trainer_workload(docs) if role == "trainer" else one(docs, "Deployment", role)
        env = env_of(workload)
        assert env["RLPIPE_NATS__NKEY_SEED_FILE"] == f"{SECRETS_DIR}/nats.nk", role
        assert env["RLPIPE_NATS__TLS_CA_FILE"] == f"{SECRETS_DIR}/ca.pem", role
        assert {"name": "secrets", "mountPath": SECRETS_DIR, "readOnly": True} in container(workload)["volumeMounts"]
        files = mounted_files(workload["spec"]["template"]["spec"], "secrets")
        assert files["nats.nk"] == (f"rlpipe-nats-{role}", "nats.nk")
        assert files["ca.pem"] == ("nats-tls", "ca.crt")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_broker_requires_tls_and_a_role_key(overlay, rendered):
    docs = rendered[overlay]
    nats_set = one(docs, "StatefulSet", "nats")
    assert container(nats_set)["args"] == ["-c", "/etc/nats/nats.conf"]
    assert {"name": "config", "mountPath": "/etc/nats", "readOnly": True} in container(nats_set)["volumeMounts"]
    files = mounted_files(nats_set["spec"]["template"]["spec"], "config")
    assert files == {
        "auth.conf": ("rlpipe-nats-auth", "auth.conf"),
        "tls/tls.crt": ("nats-tls", "tls.crt"),
        "tls/tls.key": ("nats-tls", "tls.key"),
        "tls/ca.crt": ("nats-tls", "ca.crt"),
    }
    (config_map,) = [cm for cm in find(docs, "ConfigMap") if cm["metadata"]["name"].startswith("nats-config")]
    (volume,) = [v for v in nats_set["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    assert {"configMap": {"name": config_map["metadata"]["name"]}} in volume["projected"]["sources"]  # nats.conf
    conf = config_map["data"]["nats.conf"]
    assert conf.rstrip().endswith("include ./auth.conf")
    assert conf.count("cert_file: /etc/nats/tls/tls.crt") == 2  # clients, and the cluster's routes
    assert "ca_file: /etc/nats/tls/ca.crt\n    verify: true" in conf  # a node must present a certificate too
    spec = certificate(docs, "nats-tls")
    assert {"server auth", "client auth"} <= set(spec["usages"])
    for node in range(nats_set["spec"]["replicas"]):
        assert f"nats://nats-{node}.nats-headless:6222" in conf
        assert f"nats-{node}.nats-headless" in spec["dnsNames"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_certificates_chain_to_the_namespaces_own_ca(overlay, rendered):
    docs = rendered[overlay]
    issuers = {doc["metadata"]["name"]: doc["spec"] for doc in find(docs, "Issuer")}
    ca = certificate(docs, "rlpipe-ca")
    assert ca["isCA"] is True
    assert issuers[ca["issuerRef"]["name"]] == {"selfSigned": {}}
    for name in ("nats-tls", "trainer-admin-tls"):
        spec = certificate(docs, name)
        assert spec["secretName"] == name
        assert spec["issuerRef"] == {"name": "rlpipe-ca", "kind": "Issuer", "group": "cert-manager.io"}
        assert issuers["rlpipe-ca"] == {"ca": {"secretName": ca["secretName"]}}
    # The CA's own key is mounted nowhere.
    assert all(ca["secretName"] not in secrets_read(pod) for pod in pod_templates(docs).values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_trainer_holds_the_admin_token_and_its_admin_port_speaks_tls(overlay, rendered):
    docs = rendered[overlay]
    for role in STAGES:
        assert env_of(one(docs, "Deployment", role))["RLPIPE_ADMIN_TOKEN"] == "", role  # blanks rlpipe-secrets'
        assert env_of(one(docs, "Deployment", role))["RLPIPE_ADMIN_READ_TOKEN"] == "", role
        if role != "rollout":  # nor the weight-sync token, which rlpipe-secrets might carry too
            assert env_of(one(docs, "Deployment", role))["RLPIPE_WEIGHTSYNC_TOKEN"] == "", role
    trainer = trainer_workload(docs)
    env = env_of(trainer)
    # From its file, which the kubelet refreshes when the Secret changes; never from a variable.
    assert env["RLPIPE_ADMIN_TOKEN"] == "" and env["RLPIPE_ADMIN_READ_TOKEN"] == ""
    assert "RLPIPE_ADMIN__READ_TOKEN_FILE" not in env  # no read-only token unless components/admin-read-token
    files = mounted_files(trainer["spec"]["template"]["spec"], "secrets")
    assert env["RLPIPE_ADMIN__TOKEN_FILE"] == f"{SECRETS_DIR}/admin.token"
    assert files["admin.token"] == ("rlpipe-admin", "token")
    assert (env["RLPIPE_ADMIN__TLS_CERT"], env["RLPIPE_ADMIN__TLS_KEY"]) == (
        f"{SECRETS_DIR}/admin.pem",
        f"{SECRETS_DIR}/admin.key",
    )
    assert (files["admin.pem"], files["admin.key"]) == (
        ("trainer-admin-tls", "tls.crt"),
        ("trainer-admin-tls", "tls.key"),
    )
    spec = certificate(docs, "trainer-admin-tls")
    assert one(docs, "Service", "trainer-admin")["metadata"]["name"] in spec["dnsNames"]
    assert "localhost" in spec["dnsNames"] and "127.0.0.1" in spec["ipAddresses"]  # port-forward, exec
    assert "client auth" not in spec["usages"]  # it cannot pose as a NATS node


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_admin_read_token_component_mounts_an_optional_read_token_into_the_trainer_alone(overlay, tmp_path):
    docs = render_with_component(tmp_path, overlay, "admin-read-token")
    trainer = trainer_workload(docs)
    kubernetes_validate.validate(trainer, KUBERNETES_VERSION, strict=True)
    pod = trainer["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "admin-read"]
    assert volume["secret"]["secretName"] == "rlpipe-admin-read" and volume["secret"]["defaultMode"] == 0o440
    (mount,) = [m for m in container(trainer)["volumeMounts"] if m["name"] == "admin-read"]
    assert mount["readOnly"] is True
    [item] = volume["secret"]["items"]
    env = env_of(trainer)
    assert env["RLPIPE_ADMIN__READ_TOKEN_FILE"] == f"{mount['mountPath']}/{item['path']}"
    assert env["RLPIPE_ADMIN_READ_TOKEN"] == ""  # the file, not a variable rlpipe-secrets might carry
    names = [variable["name"] for variable in container(trainer)["env"]]
    assert len(names) == len(set(names))
    assert secrets_read(pod) == EXPECTED_SECRETS["trainer"] | {"rlpipe-admin-read": {"token"}}
    for name, other in pod_templates(docs).items():  # nobody else reads it
        assert "rlpipe-admin-read" not in secrets_read(other) or name == "trainer", name


def torchrun_arguments(args: list[str]) -> list[str]:
    """The trainer container's torchrun arguments, after the wrapper that runs torchrun in its process."""
    assert args[:3] == ["python", "-m", "services.trainer.learning.distributed"]
    return args[3:]


def test_the_trainer_runs_torchrun_through_rlpipes_wrapper(rendered):
    from torch.distributed.run import parse_args

    for overlay in OVERLAYS:
        arguments = torchrun_arguments(container(trainer_workload(rendered[overlay]))["args"])
        parsed = parse_args(arguments)
        assert parsed.standalone and (parsed.nnodes, parsed.nproc_per_node) == ("1", "$(TRAINER_GPUS)")
        assert parsed.module and parsed.training_script == "services.trainer"
        assert parsed.training_script_args == ["--config", "/etc/rlpipe/$(RLPIPE_ENV).yaml"]
        assert env_of(trainer_workload(rendered[overlay]))["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "280"


def test_the_multinode_trainer_keeps_the_wrapper_its_rendezvous_and_its_secrets(tmp_path):
    from torch.distributed.run import parse_args

    # In place of the prod overlay's trainer Job, as docs/operations.md says (the multi-node pods are a StatefulSet).
    docs = render_with_component(tmp_path, "prod", "trainer-multinode", instead_of="trainer-job")
    trainer = one(docs, "StatefulSet", "trainer")
    kubernetes_validate.validate(trainer, KUBERNETES_VERSION, strict=True)
    names = [variable["name"] for variable in container(trainer)["env"]]
    assert len(names) == len(set(names)), "the component's patch merges into the base's env, not beside it"
    parsed = parse_args(torchrun_arguments(container(trainer)["args"]))
    assert (parsed.nnodes, parsed.rdzv_backend, parsed.rdzv_id) == ("$(TRAINER_NODES)", "c10d", "rlpipe-trainer")
    assert parsed.rdzv_endpoint == "trainer-0.trainer-rendezvous:29400"
    assert parsed.local_addr == "$(POD_NAME).trainer-rendezvous"
    assert not parsed.standalone and parsed.training_script == "services.trainer"
    env = env_of(trainer)
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "280" and "POD_NAME" in env
    assert secrets_read(trainer["spec"]["template"]["spec"]) == EXPECTED_SECRETS["trainer"]


# -- the secrets step and the broker, for real -----------------------------------------------------------------


def test_make_secrets_makes_the_secrets_the_pods_mount_and_keys_the_broker_admits(rendered):
    secrets = {s["metadata"]["name"]: s for s in make_k8s_secrets(PROD_CONFIG)}
    assert set(secrets) == {"rlpipe-nats-auth", "rlpipe-weightsync", *(f"rlpipe-nats-{role}" for role in ROLES)}
    assert len(decoded(secrets["rlpipe-weightsync"])["token"]) == 64
    for secret in secrets.values():
        kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    mounted = {name for pod in pod_templates(rendered["prod"]).values() for name in secrets_read(pod)}
    made_by_cert_manager = {
        certificate(rendered["prod"], c["metadata"]["name"])["secretName"]
        for c in find(rendered["prod"], "Certificate")
    }
    # What neither this script nor cert-manager makes, the operator creates (docs/operations.md).
    store_users = {f"rlpipe-store-{role}" for role in SERVICE_ROLES}  # one per role, made with the store's own tools
    assert mounted - set(secrets) - made_by_cert_manager == {"rlpipe-secrets", "rlpipe-admin", *store_users}
    auth = decoded(secrets["rlpipe-nats-auth"])["auth.conf"].decode()
    for role in ROLES:
        seed = decoded(secrets[f"rlpipe-nats-{role}"])["nats.nk"].strip()
        assert f'nkey: "{nkeys.from_seed(seed).public_key.decode()}"' in auth, role
    again = {s["metadata"]["name"]: s for s in make_k8s_secrets(PROD_CONFIG)}
    assert again["rlpipe-nats-trainer"]["data"] != secrets["rlpipe-nats-trainer"]["data"]  # fresh keys each run


def test_make_secrets_refuses_a_config_without_run_id(tmp_path):
    (tmp_path / "c.yaml").write_text("environment: prod\n")
    done = run_make_k8s_secrets(tmp_path / "c.yaml")
    assert done.returncode != 0 and done.stdout == ""
    assert "no run_id" in done.stderr


def local_node_conf(conf: str, folder: Path, node: int, ports: list[dict[str, int]]) -> str:
    """The pods' nats.conf for node ``node`` on this machine: its store, ports and route addresses moved, the
    projected volume's /etc/nats/ replaced by ``folder``. Hosts stay names the certificate covers (localhost)."""
    mine = ports[node]
    replacements = [
        ("store_dir: /data", f"store_dir: {folder / f'store-{node}'}"),
        ("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{mine['client']}"),
        ("http: 0.0.0.0:8222", f"http: 127.0.0.1:{mine['monitor']}"),
        ("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{mine['cluster']}"),
        ("/etc/nats/", f"{folder}/"),
    ]
    replacements += [(f"nats-{i}.nats-headless:6222", f"localhost:{p['cluster']}") for i, p in enumerate(ports)]
    for old, new in replacements:
        assert old in conf, old
        conf = conf.replace(old, new)
    return conf


def healthy(monitor: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=2) as reply:
            return json.load(reply) == {"status": "ok"}
    except OSError:
        return False


def plain_text_session(port: int) -> tuple[dict, bytes]:
    """What the broker announces, and answers to a client that goes on without TLS (CONNECT, PING): b"" when it
    hangs up instead of answering PONG."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        announced = json.loads(sock.recv(65536).removeprefix(b"INFO "))
        sock.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return {key: announced.get(key) for key in ("tls_required", "auth_required")}, answer


def test_the_pods_broker_config_runs_a_tls_cluster_that_admits_only_the_role_keys(rendered, tiny_model, tmp_path):
    docs = rendered["prod"]
    (config_map,) = [cm for cm in find(docs, "ConfigMap") if cm["metadata"]["name"].startswith("nats-config")]
    secrets = broker_secrets(tmp_path, certificate(docs, "nats-tls"))
    replicas = one(docs, "StatefulSet", "nats")["spec"]["replicas"]
    ports = [{"client": free_port(), "monitor": free_port(), "cluster": free_port()} for _ in range(replicas)]
    servers = []
    try:
        for node in range(replicas):
            conf = tmp_path / f"nats-{node}.conf"
            conf.write_text(local_node_conf(config_map["data"]["nats.conf"], tmp_path, node, ports))
            servers.append(
                subprocess.Popen(
                    [str(BIN / "nats-server"), "-c", str(conf)],
                    env={"POD_NAME": f"nats-{node}"},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        deadline = time.monotonic() + 60
        # Healthy only once in contact with a JetStream meta leader: the nodes found each other over TLS routes.
        while not all(healthy(p["monitor"]) for p in ports):
            assert all(server.poll() is None for server in servers), "a nats-server exited"
            assert time.monotonic() < deadline, "the cluster never became healthy"
            time.sleep(0.2)
        client = ports[0]["client"]
        run_id = load_yaml(PROD_CONFIG)["run_id"]  # the subjects the keys are allowed
        config = config_file(tmp_path, tiny_model)
        for role in ROLES:
            (tmp_path / role).mkdir()
            (tmp_path / role / "nats.nk").write_bytes(secrets[f"rlpipe-nats-{role}"]["nats.nk"])

        def as_role(role: str):
            return load_config(
                config,
                run_id=run_id,
                nats={
                    "url": f"tls://localhost:{client}",
                    "nkey_seed_file": str(tmp_path / role / "nats.nk"),
                    "tls_ca_file": str(tmp_path / "tls" / "ca.crt"),
                    "stream_replicas": replicas,
                },
            )

        async def scenario() -> None:
            trainer = await Bus(as_role("trainer"), "trainer").connect()  # makes the run's streams, 3 copies each
            info = await trainer.js.stream_info(stream_name(run_id, "prompts"))
            assert info.config.num_replicas == replicas and len(info.cluster.replicas) == replicas - 1
            await trainer.close()
            reward = await Bus(as_role("reward"), "reward").connect()  # its own key, on another node's stream
            await reward.close()
            trust = ssl.create_default_context(cafile=str(tmp_path / "tls" / "ca.crt"))
            with pytest.raises(Exception, match="Authorization Violation"):  # TLS without a key
                await nats.connect(f"tls://localhost:{client}", tls=trust, allow_reconnect=False, connect_timeout=3)
            stranger = tmp_path / "stranger.nk"
            stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
            with pytest.raises(Exception, match="Authorization Violation"):  # a key the broker does not know
                await nats.connect(
                    f"tls://localhost:{client}",
                    allow_reconnect=False,
                    connect_timeout=3,
                    **connect_options(as_role("reward").nats.model_copy(update={"nkey_seed_file": stranger}), "reward"),
                )

        asyncio.run(scenario())
        assert plain_text_session(client) == ({"tls_required": True, "auth_required": True}, b"")
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=10)
