"""deploy/compose.yaml: valid against the Compose specification, and shaped the way operations.md says."""

from __future__ import annotations

import json
import re
import subprocess

import jsonschema
import pytest

from tests.support.deploy import ALWAYS, DEPLOY, GPU_ROLES, compose_schema, load_yaml
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

RLPIPE_SERVICES = ("reference", "trainer", "rollout", "reward")
ADMIN_PORT = "${ADMIN_BIND_ADDRESS:-127.0.0.1}:50052:50052"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(DEPLOY / "compose.yaml")


@pytest.mark.integration
def test_matches_the_compose_specification(compose):
    validator = jsonschema.Draft202012Validator(compose_schema(), format_checker=jsonschema.FormatChecker())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


@pytest.mark.integration
def test_the_schema_check_catches_a_mistake(compose):
    broken = json.loads(json.dumps(compose))
    broken["services"]["trainer"]["depends_on"]["nats"]["condition"] = "service_ready"
    assert list(jsonschema.Draft202012Validator(compose_schema()).iter_errors(broken))


def depends(compose: dict, service: str) -> dict[str, str]:
    return {
        name: spec["condition"] + ("" if spec.get("required", True) else " (optional)")
        for name, spec in compose["services"][service]["depends_on"].items()
    }


def profile_services(compose: dict, *profiles: str) -> dict[str, dict]:
    """The services `docker compose --profile P ... config` keeps: those without profiles and those of a P."""
    return {
        name: service
        for name, service in compose["services"].items()
        if not service.get("profiles") or set(service["profiles"]) & set(profiles)
    }


def test_start_order_waits_on_health(compose):
    assert depends(compose, "minio-init") == {
        "minio": "service_healthy",
        "secrets-init": "service_completed_successfully",
    }
    assert depends(compose, "trainer") == {
        "archive": "service_started",  # so stopped after the trainer
        "nats": "service_healthy",
        "minio-init": "service_completed_successfully",
        "model-init": "service_completed_successfully",
    }
    assert depends(compose, "trainer-gpu") == depends(compose, "trainer")
    # Whichever trainer the profile runs: the other one is not there, so neither is required.
    after_trainer = {"trainer": "service_healthy (optional)", "trainer-gpu": "service_healthy (optional)"}
    for stage in ("reference", "reference-gpu", "rollout", "rollout-gpu", "reward"):
        assert depends(compose, stage) == after_trainer, stage


@pytest.mark.integration
def test_the_root_compose_file_includes_the_deployment_and_defaults_to_the_cpu_profile():
    root = load_yaml(ROOT / "compose.yaml")
    errors = list(jsonschema.Draft202012Validator(compose_schema()).iter_errors(root))
    assert errors == []
    # No env_file: compose reads deploy/.env for the included file when there is one, and needs none.
    assert root == {"include": [{"path": "deploy/compose.yaml"}]}
    settings = dict(
        line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines() if line and not line.startswith("#")
    )
    assert settings == {"COMPOSE_PROFILES": "cpu"}
    tracked = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT)
    assert tracked.returncode == 1, "the root .env holds no secret and must stay committable"


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_each_profile_runs_one_of_each_role_and_resolves_every_dependency(compose, profile):
    services = profile_services(compose, profile)
    suffix = "" if profile == "cpu" else "-gpu"
    assert set(services) == ALWAYS | {role + suffix for role in GPU_ROLES}
    for name, service in services.items():
        for needed, spec in service.get("depends_on", {}).items():
            assert needed in services or spec.get("required") is False, f"{name} needs {needed}, not in {profile}"
        if "depends_on" in service:
            started_after = [needed for needed in service["depends_on"] if needed in services]
            assert started_after, f"{name} would start before anything it waits for"
    # The roles reach the trainer as trainer:50051 and the cli as trainer:50052 (its certificate's name) in both.
    trainer = services["trainer" + suffix]
    assert trainer.get("networks", {"default": {"aliases": ["trainer"]}}) == {"default": {"aliases": ["trainer"]}}


def test_the_cpu_profile_needs_no_gpu_and_the_gpu_profile_puts_trainer_rollouts_and_reference_on_one(compose):
    for name, service in profile_services(compose, "cpu").items():
        assert "deploy" not in service, name
    assert compose["services"]["rollout"]["environment"]["RLPIPE_ROLLOUT__BACKEND"] == "hf"
    gpu = profile_services(compose, "gpu")
    for name in ("trainer-gpu", "rollout-gpu", "reference-gpu"):
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
        assert "RLPIPE_ROLLOUT__BACKEND" not in gpu[name]["environment"], name  # the config's (vllm)
    assert "deploy" not in gpu["reward"]
    assert gpu["reference-gpu"]["build"]["target"] == "reference-gpu"


def test_every_long_running_service_has_a_health_check_and_restart_policy(compose):
    for name, service in compose["services"].items():
        if name in ("minio-init", "model-init", "secrets-init", "cli"):
            assert service["restart"] == "no", name
            continue
        if name == "archive":  # no port to probe: a loop of store writes, each pass logged
            assert service["restart"] == "unless-stopped"
            continue
        assert service["healthcheck"]["test"], name
        assert service["restart"] in ("unless-stopped", "on-failure"), name


@pytest.mark.integration
def test_rlpipe_services_probe_grpc_health_on_their_configured_port(compose):
    services = compose["services"]
    # The ports that carry weights speak TLS with weight_sync.tls_*: their probes take port and TLS from the config.
    for role in ("trainer", "rollout"):
        assert services[role]["healthcheck"]["test"] == [
            "CMD",
            *("python", "-m", "services.cli.healthcheck", "--config", "/etc/rlpipe/config.yaml", "--role", role),
        ], role
    for name in ("reference", "reward"):
        assert (
            "services.cli.healthcheck 127.0.0.1:$${RLPIPE_SERVICE__GRPC_PORT}"
            in services[name]["healthcheck"]["test"][1]
        ), name


def test_nats_runs_jetstream_from_the_shipped_config_with_a_js_health_check(compose):
    nats = compose["services"]["nats"]
    assert nats["command"] == ["-c", "/etc/nats/nats.conf"]
    assert "./nats/nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    assert any(volume.startswith("nats-data:") for volume in nats["volumes"])
    assert "http://127.0.0.1:8222/healthz?js-enabled-only=true" in nats["healthcheck"]["test"]


def test_third_party_images_are_pinned_by_digest(compose):
    for name in ("nats", "minio", "minio-init", "prometheus", "alertmanager", "grafana"):
        assert DIGEST.search(compose["services"][name]["image"]), name


def test_stateless_roles_can_be_scaled(compose):
    # --scale needs generated container names and no fixed host ports.
    for name in ("rollout", "reward", "reference", "rollout-gpu", "reference-gpu"):
        service = compose["services"][name]
        assert "container_name" not in service and "ports" not in service, name


def test_every_port_is_bound_to_this_host_and_only_the_admin_port_can_be_opened_wider(compose):
    published = {
        (name, port)
        for name, service in compose["services"].items()
        for port in service.get("ports", [])
        if not str(port).startswith("127.0.0.1:")
    }
    assert published == {("trainer", ADMIN_PORT), ("trainer-gpu", ADMIN_PORT)}
    example = (DEPLOY / ".env.example").read_text()
    assert re.search(r"^# ADMIN_BIND_ADDRESS=0\.0\.0\.0$", example, re.MULTILINE), "the way to open it, commented out"


OPTIONAL_ENV_FILE = [{"path": ".env", "required": False}]


@pytest.mark.integration
def test_deploy_env_is_an_optional_ignored_file_of_overrides_and_no_setting_needs_it(compose):
    for name in (*RLPIPE_SERVICES, "archive", "cli", "alertmanager"):
        assert compose["services"][name]["env_file"] == OPTIONAL_ENV_FILE, name
        assert "RLPIPE_S3_SECRET_KEY" not in compose["services"][name].get("environment", {})
    # Every ${VAR} compose fills has a default ($${VAR} is the container shell's: the monitoring profile's webhook).
    required = re.findall(r"(?<!\$)\$\{([A-Z_]+)(?::?\?[^}]*)?\}", (DEPLOY / "compose.yaml").read_text())
    assert required == [], "a ${VAR} without a default makes deploy/.env necessary"
    example = (DEPLOY / ".env.example").read_text()
    assert not re.findall(r"^[A-Z_]+=", example, re.MULTILINE), "every line of .env.example is a commented override"
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/.env"], cwd=ROOT)
    assert ignored.returncode == 0, "deploy/.env must be git-ignored"
    example_ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/.env.example"], cwd=ROOT)
    assert example_ignored.returncode == 1, "deploy/.env.example must stay committable"


def test_services_mount_the_config_of_their_environment(compose):
    for name in RLPIPE_SERVICES:
        service = compose["services"][name]
        assert "./config/${RLPIPE_ENV:-dev}.yaml:/etc/rlpipe/config.yaml:ro" in service["volumes"], name
        assert service["environment"]["RLPIPE_ENV"] == "${RLPIPE_ENV:-dev}"
        assert (DEPLOY / "config" / "dev.yaml").is_file()


@pytest.mark.integration
def test_model_init_builds_the_tiny_model_into_the_shared_volumes(compose):
    init = compose["services"]["model-init"]
    assert "rlpipe build-tiny --out /models/tiny-arith --data /data/arith --seed 0" in init["command"][-1]
    assert {"models:/models", "data:/data"} <= set(init["volumes"])
    config = load_yaml(DEPLOY / "config" / "base.yaml")
    assert config["model"]["path"] == "/models/tiny-arith"
    assert config["data"]["train_path"].startswith("/data/arith/")


@pytest.mark.integration
def test_images_are_built_from_the_role_targets_of_the_one_dockerfile(compose):
    targets = {
        **{role: role for role in RLPIPE_SERVICES},
        "trainer-gpu": "trainer",
        "rollout-gpu": "rollout",
        "reference-gpu": "reference-gpu",
        "model-init": "cli",
    }
    for name, target in targets.items():
        build = compose["services"][name]["build"]
        assert (build["context"], build["dockerfile"], build["target"]) == ("..", "deploy/Dockerfile", target), name
        assert set(build["args"]) == {"VERSION", "REVISION"}, name


def test_monitoring_and_the_cli_are_optional_profiles_and_the_roles_that_want_a_gpu_come_in_two(compose):
    profiles = {name: service.get("profiles") for name, service in compose["services"].items() if "profiles" in service}
    assert profiles == {
        **{role: ["cpu"] for role in GPU_ROLES},
        **{f"{role}-gpu": ["gpu"] for role in GPU_ROLES},
        "prometheus": ["monitoring"],
        "alertmanager": ["monitoring"],
        "grafana": ["monitoring"],
        "cli": ["tools"],
    }


def test_cli_reaches_the_admin_port_with_the_token_made_at_first_start(compose):
    cli = compose["services"]["cli"]
    tls = ["--tls-ca", "/run/rlpipe/secrets/ca.pem"]
    assert cli["entrypoint"] == ["tini", "--", "rlpipe", "--address", "trainer:50052", *tls]
    assert cli["build"]["target"] == "cli"
    trainer = compose["services"]["trainer"]["environment"]
    assert trainer["RLPIPE_ADMIN__PORT"] == "50052"
    # The same token twice over (deploy/nats/make-secrets.sh): the trainer's file, the cli's RLPIPE_ADMIN_TOKEN file.
    assert trainer["RLPIPE_ADMIN__TOKEN_FILE"] == "/run/rlpipe/secrets/admin.token"
    script = (DEPLOY / "nats" / "make-secrets.sh").read_text()
    assert 'cp "$out/trainer/admin.token" "$out/operator/env/RLPIPE_ADMIN_TOKEN"' in script


def test_a_stalled_role_exits_into_a_restart_policy_that_restarts_it(compose):
    # Docker restarts on exit only, never for an unhealthy container: the roles end themselves when stalled
    # (service.exit_when_stalled_s, deploy/config, tests/deploy/test_configs.py) with exit code 3, non-zero.
    for name in (*RLPIPE_SERVICES, *(f"{role}-gpu" for role in GPU_ROLES)):
        assert compose["services"][name]["restart"] in ("unless-stopped", "on-failure", "always"), name
    for env in ("base", "dev", "test", "prod"):
        assert load_yaml(DEPLOY / "config" / f"{env}.yaml")["service"]["exit_when_stalled_s"] > 0, env


def test_no_role_reaches_a_model_hub_unless_the_deployment_allows_it(compose):
    for name in (*RLPIPE_SERVICES, *(f"{role}-gpu" for role in GPU_ROLES), "cli", "archive"):
        environment = compose["services"][name]["environment"]
        assert environment["HF_HUB_OFFLINE"] == "${HF_HUB_OFFLINE:-1}", name
        assert environment["TRANSFORMERS_OFFLINE"] == "${TRANSFORMERS_OFFLINE:-1}", name
