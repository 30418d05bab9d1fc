"""Compose runs with TLS and per-role NATS keys: secrets-init makes them, each role mounts only its own."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from services.common.config import S3Credentials, WeightSyncCredentials, load_config
from services.common.transport.bus import Bus
from services.common.transport.nats_connect import connect_options
from services.common.transport.streams import EXPERIENCE, subject
from tests.conftest import BIN, free_port, wait_for_port, write_config
from tests.deploy.conftest import DEPLOY, load_yaml

pytestmark = pytest.mark.unit

ROLES = {
    "reference": "reference",
    "reference-gpu": "reference",
    "trainer": "trainer",
    "trainer-gpu": "trainer",
    "rollout": "rollout",
    "rollout-gpu": "rollout",
    "reward": "reward",
    "cli": "operator",
}
POLICIES = {"trainer": "trainer", "rollout": "stage", "reward": "stage", "reference": "stage", "operator": "operator"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(DEPLOY / "compose.yaml")


def test_each_service_mounts_only_its_own_roles_secrets(compose):
    for service, role in ROLES.items():
        mounts = [
            v for v in compose["services"][service]["volumes"] if isinstance(v, dict) and v["source"] == "secrets"
        ]
        assert mounts == [
            {
                "type": "volume",
                "source": "secrets",
                "target": "/run/rlpipe/secrets",
                "read_only": True,
                "volume": {"subpath": role},
            },
            # Its store user and weight-sync token as files named like their variables (config's secrets dir).
            {
                "type": "volume",
                "source": "secrets",
                "target": "/run/secrets",
                "read_only": True,
                "volume": {"subpath": f"{role}/env"},
            },
        ], service
        environment = compose["services"][service]["environment"]
        assert environment["RLPIPE_NATS__URL"] == "tls://nats:4222"
        assert environment["RLPIPE_NATS__NKEY_SEED_FILE"] == "/run/rlpipe/secrets/nats.nk"
        assert environment["RLPIPE_NATS__TLS_CA_FILE"] == "/run/rlpipe/secrets/ca.pem"
        # deploy/.env reaches every service; MinIO's root user in it is blanked for all of rlpipe's.
        assert (environment["MINIO_ROOT_USER"], environment["MINIO_ROOT_PASSWORD"]) == ("", ""), service
        assert not {"RLPIPE_S3_ACCESS_KEY", "RLPIPE_S3_SECRET_KEY", "RLPIPE_WEIGHTSYNC_TOKEN"} & set(environment)


def test_minio_init_makes_one_store_user_per_role_with_its_policy_after_the_secrets_exist(compose):
    init = compose["services"]["minio-init"]
    script_and_folders = ["/opt/rlpipe/minio/init.sh", "/var/lib/rlpipe/secrets", "/opt/rlpipe/minio"]
    assert init["entrypoint"] == ["/bin/sh", *script_and_folders]
    assert init["volumes"] == ["./minio:/opt/rlpipe/minio:ro", "secrets:/var/lib/rlpipe/secrets:ro"]
    assert init["depends_on"]["secrets-init"] == {"condition": "service_completed_successfully"}
    script = (DEPLOY / "minio" / "init.sh").read_text()
    for policy in set(POLICIES.values()):
        assert (DEPLOY / "minio" / f"{policy}.json").is_file()
    assert 'mc admin policy create rlpipe "rlpipe-$policy" "$policies/$policy.json"' in script
    assert "for role in trainer rollout reward reference operator; do" in script
    assert "trainer | operator) policy=$role ;;" in script and "*) policy=stage ;;" in script


def test_the_admin_token_reaches_the_trainer_and_cli_only_and_the_admin_port_speaks_tls(compose):
    services = compose["services"]
    for stage in ("reference", "rollout", "reward"):
        assert services[stage]["environment"]["RLPIPE_ADMIN_TOKEN"] == "", stage  # blanks deploy/.env's
    assert "RLPIPE_ADMIN_TOKEN" not in services["trainer"]["environment"]
    assert services["trainer"]["environment"]["RLPIPE_ADMIN__TLS_CERT"] == "/run/rlpipe/secrets/admin.pem"
    assert services["cli"]["entrypoint"][-2:] == ["--tls-ca", "/run/rlpipe/secrets/ca.pem"]


def test_the_broker_waits_for_its_secrets(compose):
    assert compose["services"]["nats"]["depends_on"] == {
        "secrets-init": {"condition": "service_completed_successfully"}
    }
    assert "secrets:/etc/nats/secrets:ro" in compose["services"]["nats"]["volumes"]
    init = compose["services"]["secrets-init"]
    assert init["restart"] == "no" and init["build"]["target"] == "cli"


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


def make_secrets(out: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(
        ["sh", str(DEPLOY / "nats" / "make-secrets.sh"), str(out), str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.integration
def test_the_shipped_broker_config_with_made_secrets_admits_each_role_to_its_own_subjects_over_tls(
    tiny_model, tmp_path
):
    model_dir, data_dir = tiny_model
    config = write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs")
    made = make_secrets(tmp_path / "secrets", config)
    assert made.returncode == 0, made.stderr
    assert make_secrets(tmp_path / "secrets", config).stdout.startswith("secrets already in")  # kept at later starts
    for role in ("trainer", "rollout", "reward", "reference", "operator"):
        assert (tmp_path / "secrets" / role / "nats.nk").stat().st_mode & 0o777 == 0o600
    env_folders = {role: tmp_path / "secrets" / role / "env" for role in POLICIES}
    store = {role: S3Credentials(_secrets_dir=folder) for role, folder in env_folders.items()}
    assert {role: creds.access_key for role, creds in store.items()} == {role: f"rlpipe-{role}" for role in POLICIES}
    assert len({creds.secret_key for creds in store.values()}) == len(POLICIES)  # one key each, none shared
    tokens = {role: WeightSyncCredentials(_secrets_dir=folder).token for role, folder in env_folders.items()}
    assert tokens["trainer"] == tokens["rollout"] and len(tokens["trainer"]) == 64
    assert (tokens["reward"], tokens["reference"], tokens["operator"]) == ("", "", "")
    port = free_port()
    local_compose_conf(tmp_path, port, free_port())
    server = subprocess.Popen(
        [str(BIN / "nats-server"), "-c", str(tmp_path / "nats.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    wait_for_port(port, server, "nats-server")

    def as_role(role: str):
        folder = tmp_path / "secrets" / role
        return load_config(
            config,
            nats={
                "url": f"tls://localhost:{port}",
                "nkey_seed_file": str(folder / "nats.nk"),
                "tls_ca_file": str(folder / "ca.pem"),
            },
        )

    async def scenario() -> list[str]:
        await (await Bus(as_role("trainer"), "trainer").connect()).close()  # the trainer creates the streams
        reward = await Bus(as_role("reward"), "reward").connect()  # TLS, its key, the streams and its consumer
        await reward.work_queue("rollouts")
        errors: list[str] = []

        async def remember(error: Exception) -> None:
            errors.append(str(error))

        await reward.close()
        nc = await nats.connect(
            f"tls://localhost:{port}", error_cb=remember, **connect_options(as_role("reward").nats, "reward")
        )
        with pytest.raises(nats.errors.TimeoutError):
            await nc.jetstream().publish(subject("test", EXPERIENCE), b"forged", timeout=2)
        await nc.close()
        trust = ssl.create_default_context(cafile=str(tmp_path / "secrets" / "tls" / "ca.pem"))
        with pytest.raises(Exception, match="Authorization Violation"):  # TLS without a key
            await nats.connect(f"tls://localhost:{port}", tls=trust, allow_reconnect=False, connect_timeout=3)
        return errors

    try:
        errors = asyncio.run(scenario())
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert f'nats: permissions violation for publish to "{subject("test", EXPERIENCE)}"' in errors
