"""Compose runs with TLS and per-role NATS keys: secrets-init makes them, each role mounts only its own."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path

import nats
import pytest
from cryptography import x509

from services.cli.healthcheck import check
from services.common.config import (
    AdminCredentials,
    CheckpointConfig,
    S3Credentials,
    WeightSyncCredentials,
    load_config,
)
from services.common.service import start_grpc_server
from services.common.transport import weight_sync_tls
from services.common.transport.bus import Bus
from services.common.transport.nats_connect import connect_options
from services.common.transport.storage import open_store
from services.common.transport.streams import EXPERIENCE, subject
from tests.support.deploy import DEPLOY, load_yaml, local_compose_conf, make_compose_secrets
from tests.support.paths import BIN
from tests.support.runs import config_file
from tests.support.servers import free_port, wait_for_port

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
        # MinIO speaks TLS only; its certificate chains to the deployment's CA, in every role's folder.
        assert environment["RLPIPE_CHECKPOINT__S3_SECURE"] == "true"
        assert environment["RLPIPE_CHECKPOINT__S3_CA_FILE"] == "/run/rlpipe/secrets/ca.pem"
        assert not {"RLPIPE_S3_ACCESS_KEY", "RLPIPE_S3_SECRET_KEY", "RLPIPE_WEIGHTSYNC_TOKEN"} & set(environment)
        assert not {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"} & set(environment)


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


def test_the_admin_tokens_reach_the_trainer_and_cli_only_and_the_admin_port_speaks_tls(compose):
    services = compose["services"]
    for stage in ("reference", "rollout", "reward"):
        for token in ("RLPIPE_ADMIN_TOKEN", "RLPIPE_ADMIN_READ_TOKEN"):
            assert services[stage]["environment"][token] == "", (stage, token)  # blanks deploy/.env's
    for token in ("RLPIPE_ADMIN_TOKEN", "RLPIPE_ADMIN_READ_TOKEN"):
        assert token not in services["trainer"]["environment"], token  # deploy/.env's reaches it
    assert services["trainer"]["environment"]["RLPIPE_ADMIN__TLS_CERT"] == "/run/rlpipe/secrets/admin.pem"
    assert services["cli"]["entrypoint"][-2:] == ["--tls-ca", "/run/rlpipe/secrets/ca.pem"]


def test_every_connection_of_the_shipped_compose_is_encrypted_by_default(compose):
    services = compose["services"]
    # WeightSync: the trainer serves the weight-sync certificate; the rollouts check it and serve it on their relays.
    weights = {
        "RLPIPE_WEIGHT_SYNC__TLS_CERT": "/run/rlpipe/secrets/weights.pem",
        "RLPIPE_WEIGHT_SYNC__TLS_KEY": "/run/rlpipe/secrets/weights.key",
        "RLPIPE_WEIGHT_SYNC__TLS_CA": "/run/rlpipe/secrets/ca.pem",
    }
    for name in ("trainer", "trainer-gpu", "rollout", "rollout-gpu"):
        environment = services[name]["environment"]
        assert {key: environment.get(key) for key in weights} == weights, name
    for name in ("reward", "reference", "reference-gpu"):  # they take no weights: no certificate to hold
        assert not {key for key in services[name]["environment"] if key.startswith("RLPIPE_WEIGHT_SYNC__")}, name
    # MinIO: HTTPS only, from its certificate folder, probed over HTTPS; its root user from files, not variables.
    minio = services["minio"]
    assert minio["command"][-2:] == ["--certs-dir", "/certs"]
    mounts = {v["target"]: v["volume"]["subpath"] for v in minio["volumes"] if isinstance(v, dict)}
    assert mounts == {"/certs": "minio", "/run/secrets": "minio-root"}
    assert "https://localhost:9000/minio/health/live" in minio["healthcheck"]["test"]
    assert "--cacert" in minio["healthcheck"]["test"]
    script = (DEPLOY / "minio" / "init.sh").read_text()
    assert "@minio:9000" in script and "http://" not in script and 'certs/CAs/rlpipe-ca.pem"' in script
    # The Admin port: TLS, loopback-published (tests/deploy/test_compose.py), and an allowlist of private networks.
    trainer = services["trainer"]["environment"]
    assert trainer["RLPIPE_ADMIN__TLS_CERT"] == "/run/rlpipe/secrets/admin.pem"
    sources = trainer["RLPIPE_ADMIN__ALLOWED_SOURCES"]
    assert sources.startswith("${ADMIN_ALLOWED_SOURCES:-") and "0.0.0.0/0" not in sources


def test_the_broker_waits_for_its_secrets(compose):
    assert compose["services"]["nats"]["depends_on"] == {
        "secrets-init": {"condition": "service_completed_successfully"}
    }
    assert "secrets:/etc/nats/secrets:ro" in compose["services"]["nats"]["volumes"]
    init = compose["services"]["secrets-init"]
    assert init["restart"] == "no" and init["build"]["target"] == "cli"


@pytest.mark.integration
def test_the_shipped_broker_config_with_made_secrets_admits_each_role_to_its_own_subjects_over_tls(
    tiny_model, tmp_path
):
    config = config_file(tmp_path, tiny_model)
    made = make_compose_secrets(tmp_path / "secrets", config)
    assert made.returncode == 0, made.stderr
    assert make_compose_secrets(tmp_path / "secrets", config).stdout.startswith(
        "secrets already in"
    )  # kept at later starts
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


def certificate_names(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


@pytest.mark.integration
def test_made_secrets_serve_minio_and_weight_sync_over_tls_that_only_the_deployments_ca_trusts(
    config_only_model, tmp_path, monkeypatch
):
    config = config_file(tmp_path, config_only_model)
    secrets = tmp_path / "secrets"
    made = make_compose_secrets(secrets, config)
    assert made.returncode == 0, made.stderr
    ca_cert = x509.load_pem_x509_certificate((secrets / "ca" / "ca.pem").read_bytes())
    for path, host in (
        (secrets / "minio" / "public.crt", "minio"),
        (secrets / "trainer" / "weights.pem", "trainer"),
        (secrets / "rollout" / "weights.pem", "trainer"),
        (secrets / "trainer" / "admin.pem", "trainer"),
    ):
        x509.load_pem_x509_certificate(path.read_bytes()).verify_directly_issued_by(ca_cert)
        assert certificate_names(path)[0] == host, path
    # The weight-sync key is not the Admin port's: a rollout holding it cannot pose as the Admin port.
    assert (secrets / "trainer" / "weights.key").read_bytes() != (secrets / "trainer" / "admin.key").read_bytes()
    for secret in ("trainer/admin.token", "minio-root/MINIO_ROOT_PASSWORD", "minio/private.key"):
        assert (secrets / secret).stat().st_mode & 0o777 == 0o600, secret
    admin_token = (secrets / "trainer" / "admin.token").read_text()
    assert AdminCredentials(_secrets_dir=secrets / "operator" / "env").token == admin_token and len(admin_token) == 64

    # MinIO's certificate, served by an S3 endpoint: the deployment's CA (checkpoint.s3_ca_file) trusts it, the
    # public CAs do not.
    port = free_port()
    tls = ("--ssl-cert", str(secrets / "minio" / "public.crt"), "--ssl-key", str(secrets / "minio" / "private.key"))
    server = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port), *tls],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    monkeypatch.setenv("RLPIPE_S3_ACCESS_KEY", "testing")
    monkeypatch.setenv("RLPIPE_S3_SECRET_KEY", "testing")
    try:
        wait_for_port(port, server, "moto_server")
        checkpoint = {"s3_endpoint": f"localhost:{port}", "s3_secure": True}
        trusted = CheckpointConfig(**checkpoint, s3_ca_file=secrets / "operator" / "ca.pem")
        store = open_store("s3://rlpipe/checkpoints", trusted)
        store.put("probe", b"over tls")
        assert store.get("probe") == b"over tls"
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
            open_store("s3://rlpipe/checkpoints", CheckpointConfig(**checkpoint)).get("probe")
    finally:
        server.terminate()
        server.wait(timeout=10)

    # WeightSync: the trainer serves the made certificate; a rollout's config (its folder's CA, the name trainer)
    # checks it, as the rollouts and the container probes do.
    def as_role(role: str):
        folder = secrets / role
        return load_config(
            config,
            service={"host": "127.0.0.1", "trainer_host": "trainer"},
            weight_sync={
                "tls_cert": str(folder / "weights.pem"),
                "tls_key": str(folder / "weights.key"),
                "tls_ca": str(folder / "ca.pem"),
            },
        )

    async def probe() -> tuple[str | None, str | None]:
        trainer, rollout = as_role("trainer"), as_role("rollout")
        server, address = await start_grpc_server(
            trainer,
            0,
            credentials=weight_sync_tls.server_credentials(
                trainer.weight_sync, trainer.rollout, weight_sync_tls.TRAINER
            ),
        )
        try:
            over_tls = weight_sync_tls.channel_credentials(rollout.weight_sync)
            checked = await asyncio.to_thread(
                check, address, 5.0, "", over_tls, weight_sync_tls.name_override(rollout.service)
            )
            plain = await asyncio.to_thread(check, address, 5.0)
        finally:
            await server.stop(grace=0)
        return checked, plain

    checked, plain = asyncio.run(probe())
    assert checked is None  # SERVING, over TLS checked against the deployment's CA under the name trainer
    assert plain is not None and "UNAVAILABLE" in plain  # the port speaks TLS only
