"""What the deployment tests share: where the deploy files are, kubectl and the rendered k8s overlays, the manifests'
parts (workloads, containers, mounts), Compose's schema and services, and the broker configs of both deployments
made runnable on this machine with the secrets their scripts make."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import yaml

from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy"
OVERLAYS = ("dev", "prod")
# Where deploy/install-kubectl.sh (run by `make install` and .ci/run) puts the pinned kubectl.
PINNED_KUBECTL = ROOT / "build" / "tools" / "bin" / "kubectl"


def kubectl() -> str:
    found = str(PINNED_KUBECTL) if PINNED_KUBECTL.is_file() else shutil.which("kubectl")
    if not found:
        pytest.fail("no kubectl: run `sh deploy/install-kubectl.sh` (`make install` does)")
    return found


def render(overlay: str) -> list[dict]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def trainer(docs: list[dict]) -> dict:
    """The trainer's workload: the base's StatefulSet, or the Job of components/trainer-job (the prod overlay)."""
    found = find(docs, "StatefulSet", "trainer") + find(docs, "Job", "trainer")
    assert len(found) == 1, f"expected one trainer workload, found {[d['kind'] for d in found]}"
    return found[0]


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


KUBERNETES_VERSION = "1.33"
HEALTH_PORT, TRAINER_PORT, ADMIN_PORT, METRICS_PORT = 50061, 50051, 50052, 9400


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env_map(docs: list[dict]) -> dict[str, str]:
    (config_map,) = [cm for cm in find(docs, "ConfigMap") if cm["metadata"]["name"].startswith("rlpipe-env")]
    return config_map["data"]


PROD_CONFIG = DEPLOY / "config" / "prod.yaml"


def mounted_files(pod: dict, volume_name: str) -> dict[str, tuple[str, str]]:
    """The files of a projected volume: path -> (Secret or ConfigMap name, key)."""
    (volume,) = [v for v in pod["volumes"] if v["name"] == volume_name]
    files = {}
    for source in volume["projected"]["sources"]:
        ((_, ref),) = source.items()
        for item in ref.get("items", []):
            files[item["path"]] = (ref["name"], item["key"])
    return files


def render_with_component(tmp_path: Path, overlay: str, component: str, instead_of: str = "") -> list[dict]:
    """``overlay`` with ``components/<component>`` added (before components/run, which stays last), in place of
    ``components/<instead_of>`` if given, as docs/operations.md says to do."""
    source = DEPLOY / "k8s" / "overlays" / overlay
    for path in source.iterdir():
        shutil.copy(path, tmp_path / path.name)
    kustomization = yaml.safe_load((source / "kustomization.yaml").read_text())

    def moved(ref: str) -> str:
        return os.path.relpath(source / ref, tmp_path) if ref.startswith("..") else ref

    kustomization["resources"] = [moved(ref) for ref in kustomization["resources"]]
    components = [moved(ref) for ref in kustomization.get("components", []) if Path(ref).name != instead_of]
    components.insert(-1, os.path.relpath(DEPLOY / "k8s" / "components" / component, tmp_path))
    kustomization["components"] = components
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    done = subprocess.run([kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def run_make_k8s_secrets(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", str(DEPLOY / "k8s" / "make-secrets.sh"), str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )


def make_k8s_secrets(config: Path) -> list[dict]:
    done = run_make_k8s_secrets(config)
    assert done.returncode == 0, done.stderr
    return list(yaml.safe_load_all(done.stdout))


def decoded(secret: dict) -> dict[str, bytes]:
    return {key: base64.b64decode(value) for key, value in secret["data"].items()}


def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def issue_certificates(folder: Path, spec: dict) -> None:
    """What cert-manager puts in the Secret nats-tls (tls.crt, tls.key, ca.crt), made with openssl from the
    rendered Certificate's names and usages."""
    folder.mkdir()
    ca_key, ca, key, request = folder / "ca.key", folder / "ca.crt", folder / "tls.key", folder / "tls.csr"
    new_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    openssl("req", "-x509", *new_key, "-days", "2", "-subj", "/CN=test CA", "-keyout", ca_key, "-out", ca)
    openssl("req", *new_key, "-subj", f"/CN={spec['commonName']}", "-keyout", key, "-out", request)
    usage = {"server auth": "serverAuth", "client auth": "clientAuth"}
    (folder / "ext").write_text(
        f"subjectAltName={','.join(f'DNS:{name}' for name in spec['dnsNames'])}\n"
        f"extendedKeyUsage={','.join(usage[u] for u in spec['usages'] if u in usage)}\n"
    )
    openssl(
        "x509",
        "-req",
        "-in",
        request,
        "-CA",
        ca,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        folder / "ext",
        "-out",
        folder / "tls.crt",
    )


def broker_secrets(folder: Path, nats_certificate: dict) -> dict[str, dict[str, bytes]]:
    """``folder`` laid out as the NATS pods' /etc/nats, but for nats.conf: auth.conf from make-secrets.sh and tls/
    as cert-manager issues ``nats_certificate``. Returns every Secret make-secrets.sh made, decoded."""
    secrets = {s["metadata"]["name"]: decoded(s) for s in make_k8s_secrets(PROD_CONFIG)}
    (folder / "auth.conf").write_bytes(secrets["rlpipe-nats-auth"]["auth.conf"])
    issue_certificates(folder / "tls", nats_certificate)
    return secrets


def k8s_conf_with_secrets(folder: Path) -> Path:
    """deploy/k8s/base/nats/nats.conf runnable here, with its secrets in ``folder`` where the pods have /etc/nats."""
    specs = yaml.safe_load_all((DEPLOY / "k8s" / "components" / "cert-manager" / "certificates.yaml").read_text())
    (nats_certificate,) = [doc["spec"] for doc in specs if doc["metadata"]["name"] == "nats-tls"]
    broker_secrets(folder, nats_certificate)
    conf = (DEPLOY / "k8s" / "base" / "nats" / "nats.conf").read_text()
    assert "/etc/nats/" in conf
    (folder / "nats.conf").write_text(conf.replace("/etc/nats/", f"{folder}/"))
    return folder / "nats.conf"


GPU_ROLES = ("trainer", "rollout", "reference")  # each also as <role>-gpu in the gpu profile
ALWAYS = {"nats", "secrets-init", "minio", "minio-init", "model-init", "reward", "archive"}


def compose_schema() -> dict:
    # The Compose specification's own JSON schema, as vendored (with its licence) by check-jsonschema.
    return json.loads((resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())


def local_compose_conf(folder: Path, port: int, monitor: int) -> Path:
    """deploy/nats/nats.conf with its store, ports and secrets moved into ``folder`` (secrets made in
    ``folder/secrets``, where its include finds auth.conf)."""
    conf = (DEPLOY / "nats" / "nats.conf").read_text()
    for old, new in (
        ("store_dir: /data", f"store_dir: {folder / 'store'}"),
        ("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{port}"),
        ("http: 0.0.0.0:8222", f"http: 127.0.0.1:{monitor}"),
        ("/etc/nats/secrets", str(folder / "secrets")),
    ):
        assert old in conf
        conf = conf.replace(old, new)
    (folder / "nats.conf").write_text(conf)
    return folder / "nats.conf"


def make_compose_secrets(out: Path, config: Path) -> subprocess.CompletedProcess:
    """deploy/nats/make-secrets.sh OUT CONFIG, as Compose's secrets-init runs it."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(
        ["sh", str(DEPLOY / "nats" / "make-secrets.sh"), str(out), str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
