"""How a run's logs and record leave a container or a pod for the run archive: every rlpipe service also logs to a
file in a shared folder (service.log_dir), and `rlpipe archive --every` beside the trainer copies that folder and the
trainer's runs volume to <store>/<run>/archive/ (docs/operations.md, "Log archive")."""

from __future__ import annotations

import pytest

from tests.support.deploy import DEPLOY, OVERLAYS, load_yaml
from tests.support.deploy import trainer as trainer_workload

pytestmark = pytest.mark.unit

LOGS = "/var/lib/rlpipe/logs"
ROLES = ("reference", "reference-gpu", "trainer", "trainer-gpu", "rollout", "rollout-gpu", "reward")


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(DEPLOY / "compose.yaml")


def test_every_compose_role_writes_its_log_into_the_shared_logs_volume(compose):
    services = compose["services"]
    for name in ROLES:
        assert services[name]["environment"]["RLPIPE_SERVICE__LOG_DIR"] == LOGS, name
        assert f"logs:{LOGS}" in services[name]["volumes"], name  # writable
    assert "logs" in compose["volumes"]
    # The image makes the folder its user's, so a fresh named volume mounted there is too.
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    folders = [line for line in dockerfile.splitlines() if "install -d -o rlpipe -g rlpipe" in line]
    assert len(folders) == 2 and all(f" {LOGS} " in line for line in folders)


def test_the_compose_archiver_reads_the_runs_and_logs_and_outlives_the_trainer(compose):
    archive = compose["services"]["archive"]
    assert archive["entrypoint"] == [
        "tini", "--", "rlpipe", "archive", "--config", "/etc/rlpipe/config.yaml", "--every", "600",
    ]  # fmt: skip
    assert {"runs:/var/lib/rlpipe/runs:ro", f"logs:{LOGS}:ro"} <= {v for v in archive["volumes"] if isinstance(v, str)}
    assert archive["environment"]["RLPIPE_SERVICE__LOG_DIR"] == LOGS  # what --logs defaults to
    # The trainer's store user: the archive goes under the trainer's checkpoints prefix.
    (credentials,) = [v for v in archive["volumes"] if isinstance(v, dict) and v["target"] == "/run/secrets"]
    assert credentials["volume"] == {"subpath": "trainer/env"} and credentials["read_only"] is True
    # Beside them the CA alone, which MinIO's certificate chains to.
    (ca,) = [v for v in archive["volumes"] if isinstance(v, dict) and v["target"] == "/run/rlpipe/secrets"]
    assert ca["volume"] == {"subpath": "ca"} and ca["read_only"] is True
    environment = archive["environment"]
    assert environment["RLPIPE_CHECKPOINT__S3_CA_FILE"] == "/run/rlpipe/secrets/ca.pem"
    assert environment["RLPIPE_ADMIN_TOKEN"] == ""  # no admin token, even one deploy/.env sets
    assert environment["RLPIPE_ADMIN_READ_TOKEN"] == ""  # nor the read-only one
    # No file the container lacks: the config refuses a NATS key or CA it names and cannot find.
    assert "RLPIPE_NATS__NKEY_SEED_FILE" not in environment and "RLPIPE_NATS__TLS_CA_FILE" not in environment
    assert "profiles" not in archive  # in every profile, beside whichever trainer runs
    for trainer in ("trainer", "trainer-gpu"):
        # Compose stops a service before those it depends on: the archiver's last pass follows the trainer's end.
        assert compose["services"][trainer]["depends_on"]["archive"] == {"condition": "service_started"}
    assert archive["restart"] == "unless-stopped" and archive["stop_grace_period"] == "120s"


@pytest.mark.integration
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_trainer_pod_runs_the_archiver_as_a_native_sidecar_over_its_volumes(overlay, rendered):
    pod = trainer_workload(rendered[overlay])["spec"]["template"]["spec"]
    (archive,) = pod["initContainers"]
    trainer = pod["containers"][0]
    assert archive["name"] == "archive" and archive["restartPolicy"] == "Always"  # stopped after the trainer
    assert archive["args"] == ["sh", "-c", 'exec rlpipe archive --config "/etc/rlpipe/${RLPIPE_ENV}.yaml" --every 600']
    assert archive["image"].split(":")[0] == "rlpipe/cli"
    mounts = {m["mountPath"]: m for m in archive["volumeMounts"]}
    trainer_mounts = {m["mountPath"]: m for m in trainer["volumeMounts"]}
    for path in ("/var/lib/rlpipe/runs", LOGS):
        assert mounts[path]["readOnly"] is True, path
        assert mounts[path]["name"] == trainer_mounts[path]["name"], path  # the trainer's own volumes
        assert not trainer_mounts[path].get("readOnly"), path
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts[LOGS]["name"]]
    assert {"name": "RLPIPE_SERVICE__LOG_DIR", "value": LOGS} in trainer["env"]
    assert {"name": "RLPIPE_SERVICE__LOG_DIR", "value": LOGS} in archive["env"]
    # The trainer's store user, and nothing else secret: no NATS key, no admin token.
    assert archive["envFrom"] == [
        {"configMapRef": {"name": trainer["envFrom"][0]["configMapRef"]["name"]}},
        {"secretRef": {"name": "rlpipe-store-trainer"}},
    ]
    assert archive["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
