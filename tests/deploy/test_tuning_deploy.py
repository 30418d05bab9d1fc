"""The tuning profile: deploy/compose.tune.yaml layered on compose.yaml, and the k8s component `tuning` added to
an overlay: valid, scalable, and every worker pointed at one study through one storage setting."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.tuner.tune_file import load_tune_file
from tests.support.deploy import DEPLOY, KUBERNETES_VERSION, compose_schema, kubectl, load_yaml, one
from tests.support.deploy import trainer as trainer_workload
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration

TUNING = DEPLOY / "k8s" / "components" / "tuning"
STUDY_FILE = TUNING / "tune.yaml"
DEFAULT_STORAGE = "${RLPIPE_TUNE_STORAGE:-postgresql://rlpipe:${TUNE_DB_PASSWORD:-}@postgres:5432/optuna}"


@pytest.fixture(scope="module")
def tune_compose() -> dict:
    return load_yaml(DEPLOY / "compose.tune.yaml")


@pytest.fixture(scope="module")
def merged(tune_compose) -> dict:
    """`docker compose -f compose.yaml -f compose.tune.yaml config`, for files that add services and volumes only."""
    main = load_yaml(DEPLOY / "compose.yaml")
    assert not set(main["services"]) & set(tune_compose["services"]), "the profile adds services, it changes none"
    assert not set(main.get("volumes", {})) & set(tune_compose["volumes"])
    assert set(tune_compose) == {"services", "volumes"}
    return {
        **main,
        "services": {**main["services"], **tune_compose["services"]},
        "volumes": {**main.get("volumes", {}), **tune_compose["volumes"]},
    }


def schema_errors(document: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(compose_schema(), format_checker=jsonschema.FormatChecker())
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_the_tuning_compose_file_alone_and_layered_matches_the_compose_specification(tune_compose, merged):
    assert schema_errors(tune_compose) == []
    assert schema_errors(merged) == []


def test_everything_the_workers_need_is_defined_once_layered(merged):
    services, volumes = merged["services"], merged["volumes"]
    tuner = services["tuner"]
    assert set(tuner["depends_on"]) == {"postgres", "model-init"}
    assert tuner["depends_on"]["postgres"]["condition"] == "service_healthy"
    for mount in tuner["volumes"]:
        source = mount.replace("${RLPIPE_ENV:-dev}", "dev").split(":")[0]
        if not source.startswith("."):
            assert source in volumes, source
        else:
            assert (DEPLOY / source).is_file(), source


def test_workers_scale_and_only_start_with_the_tune_profile(tune_compose):
    services = tune_compose["services"]
    assert {name: s["profiles"] for name, s in services.items()} == {"postgres": ["tune"], "tuner": ["tune"]}
    tuner = services["tuner"]
    assert "container_name" not in tuner and "ports" not in tuner  # --scale needs both absent
    assert tuner["deploy"]["replicas"] == 2
    assert tuner["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    assert tuner["command"] == ["rlpipe", "tune", "--worker", "/etc/rlpipe/tune.yaml"]
    assert tuner["restart"] == "on-failure"  # a worker done at the budget stays done
    assert services["postgres"]["ports"] == ["127.0.0.1:5432:5432"]


def test_the_study_storage_is_one_setting_shared_by_every_worker(tune_compose):
    tuner = tune_compose["services"]["tuner"]
    assert tuner["environment"]["RLPIPE_TUNE_STORAGE"] == DEFAULT_STORAGE
    postgres = tune_compose["services"]["postgres"]["environment"]
    assert (postgres["POSTGRES_USER"], postgres["POSTGRES_DB"]) == ("rlpipe", "optuna")
    assert postgres["POSTGRES_PASSWORD"].startswith("${TUNE_DB_PASSWORD:?")
    assert "storage" not in load_yaml(STUDY_FILE)  # else the file and the setting could disagree


def test_the_tuner_image_adds_the_tune_extra_at_the_locks_pins(tune_compose):
    inline = tune_compose["services"]["tuner"]["build"]["dockerfile_inline"]
    assert inline.startswith("FROM rlpipe/trainer:${IMAGE_TAG:-0.1.0}\n")
    installed = dict(re.findall(r"\b(optuna|psycopg|psycopg-binary)==(\S+)", inline))
    lock = dict(re.findall(r"^(optuna|psycopg|psycopg-binary)==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M))
    assert installed == lock and set(installed) == {"optuna", "psycopg", "psycopg-binary"}


def test_the_deployed_study_file_loads_against_the_deployment_config(tmp_path, tiny_model):
    model_dir, data_dir = tiny_model
    config = load_yaml(DEPLOY / "config" / "dev.yaml")
    config["model"]["path"] = str(model_dir)
    config["data"] |= {"train_path": str(data_dir / "train.jsonl"), "eval_path": str(data_dir / "eval.jsonl")}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    study = load_yaml(STUDY_FILE) | {"base_config": str(tmp_path / "config.yaml")}
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump(study))
    spec, _ = load_tune_file(tmp_path / "tune.yaml", "postgresql://rlpipe:pw@postgres:5432/optuna")
    assert spec.storage == "postgresql://rlpipe:pw@postgres:5432/optuna"
    assert load_yaml(STUDY_FILE)["base_config"] == "/etc/rlpipe/config.yaml"  # where compose and k8s mount it


# -- Kubernetes --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tuning_overlay(tmp_path_factory) -> list[dict]:
    """The dev overlay with `components: [.../components/tuning]` added, as docs/operations.md says to do."""
    folder = tmp_path_factory.mktemp("overlay")
    for path in (DEPLOY / "k8s" / "overlays" / "dev").iterdir():
        shutil.copy(path, folder / path.name)
    kustomization = load_yaml(folder / "kustomization.yaml")
    kustomization["resources"] = [
        os.path.relpath(DEPLOY / "k8s" / "base", folder) if r == "../../base" else r for r in kustomization["resources"]
    ]
    kustomization["components"] = [os.path.relpath(TUNING, folder)]
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    done = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def tuning_docs(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "tuning"]


def test_the_tuning_component_renders_valid_resources_in_the_overlay_namespace(tuning_overlay):
    docs = tuning_docs(tuning_overlay)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("Job", "tuner"),
        ("Service", "tune-postgres"),
        ("StatefulSet", "tune-postgres"),
    ]
    for doc in docs:
        assert doc["metadata"]["namespace"] == "rlpipe-dev"
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_tuner_is_an_indexed_job_of_workers_on_one_study(tuning_overlay):
    job = one(tuning_overlay, "Job", "tuner")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"] == 4
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure"  # a crashed worker restarts in its pod and recovers its trial
    (container,) = pod["containers"]
    assert container["args"] == ["rlpipe", "tune", "--worker", "/etc/rlpipe/tune/tune.yaml"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Its trials read the deployment's secrets as the trainer does: rlpipe-secrets, and the trainer's store user
    # last (it wins over store keys an older rlpipe-secrets carries); the same objects, as rendered, as its envFrom.
    trainer = trainer_workload(tuning_overlay)["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == trainer["envFrom"]
    assert container["envFrom"][1:] == [
        {"secretRef": {"name": "rlpipe-secrets"}},
        {"secretRef": {"name": "rlpipe-store-trainer"}},
    ]
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert env["RLPIPE_TUNE_STORAGE"] == {"secretKeyRef": {"name": "rlpipe-tune", "key": "RLPIPE_TUNE_STORAGE"}}
    # The deployment's own run config, chosen by the overlay's RLPIPE_ENV, is the study's base config.
    env_map = next(
        d for d in tuning_overlay if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("rlpipe-env")
    )
    assert env["RLPIPE_ENV"]["configMapKeyRef"]["name"] == env_map["metadata"]["name"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/etc/rlpipe/config.yaml"]["subPathExpr"] == "$(RLPIPE_ENV).yaml"
    volumes = {v["name"]: v for v in pod["volumes"]}
    study_map = one(tuning_overlay, "ConfigMap", volumes[mounts["/etc/rlpipe/tune"]["name"]]["configMap"]["name"])
    assert study_map["data"]["tune.yaml"] == STUDY_FILE.read_text()  # the same study file compose mounts


def test_the_study_database_is_a_stateful_postgresql_behind_its_service(tuning_overlay):
    service = one(tuning_overlay, "Service", "tune-postgres")
    database = one(tuning_overlay, "StatefulSet", "tune-postgres")
    pod = database["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [{"name": "postgres", "port": 5432, "targetPort": "postgres"}]
    (container,) = pod["spec"]["containers"]
    assert re.search(r"^postgres:[\w.-]+@sha256:[0-9a-f]{64}$", container["image"])
    password = next(e for e in container["env"] if e["name"] == "POSTGRES_PASSWORD")
    assert password["valueFrom"] == {"secretKeyRef": {"name": "rlpipe-tune", "key": "POSTGRES_PASSWORD"}}
    assert database["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_the_overlays_do_not_tune_unless_asked(rendered):
    for docs in rendered.values():
        assert tuning_docs(docs) == []


@pytest.mark.unit
def test_the_study_file_shipped_with_the_component_is_the_one_compose_mounts():
    compose = load_yaml(DEPLOY / "compose.tune.yaml")
    mount = next(m for m in compose["services"]["tuner"]["volumes"] if m.endswith(":/etc/rlpipe/tune.yaml:ro"))
    assert (DEPLOY / mount.split(":")[0]).resolve() == Path(STUDY_FILE).resolve()
