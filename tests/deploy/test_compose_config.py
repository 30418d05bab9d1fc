"""`docker compose config` (Compose v2, deploy/install-compose.sh) on the root compose.yaml, run where an operator
runs `docker compose up`: the include of deploy/compose.yaml, ./.env's profile, and deploy/.env's overrides when
there is one. It reads files only, so no Docker engine is needed; a copy of the files is rendered as a clone has
them, with no deploy/.env: `up` needs no step before it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.deploy import ALWAYS, GPU_ROLES
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration

# Where deploy/install-compose.sh (run by `make install` and .ci/run) puts Compose.
PINNED_COMPOSE = ROOT / "build" / "tools" / "bin" / "docker-compose"


def docker_compose() -> str:
    if not PINNED_COMPOSE.is_file():
        pytest.fail("no docker-compose: run `sh deploy/install-compose.sh` (`make install` does)")
    return str(PINNED_COMPOSE)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The root compose.yaml, ./.env and deploy/ as a clone has them: no deploy/.env."""
    shutil.copy(ROOT / "compose.yaml", tmp_path)
    shutil.copy(ROOT / ".env", tmp_path)
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy", ignore=shutil.ignore_patterns(".env"))
    return tmp_path


def compose_config(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The operator's shell picks no profile: ./.env's COMPOSE_PROFILES does.
    env = {name: value for name, value in os.environ.items() if not name.startswith("COMPOSE_")}
    return subprocess.run(
        [docker_compose(), *args, "config", "--format", "json"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def rendered(folder: Path, *args: str) -> dict:
    done = compose_config(folder, *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_docker_compose_up_from_a_clone_runs_the_cpu_profile_with_no_env_file_written_first(checkout):
    assert not (checkout / "deploy" / ".env").exists()
    services = rendered(checkout)["services"]
    assert set(services) == ALWAYS | set(GPU_ROLES)
    assert all("deploy" not in service or not service["deploy"].get("resources") for service in services.values())
    assert services["rollout"]["environment"]["RLPIPE_ROLLOUT__BACKEND"] == "hf"
    # The secrets come from the volume secrets-init fills, never from the file: MinIO reads its root user there.
    assert services["minio"]["environment"] == {
        "MINIO_ROOT_USER_FILE": "MINIO_ROOT_USER",
        "MINIO_ROOT_PASSWORD_FILE": "MINIO_ROOT_PASSWORD",
    }
    trainer = services["trainer"]
    assert trainer["environment"]["RLPIPE_ENV"] == "dev"
    assert trainer["environment"]["HF_HUB_OFFLINE"] == "1"
    assert [(port["host_ip"], port["published"]) for port in trainer["ports"]] == [("127.0.0.1", "50052")]


def test_a_deploy_env_file_overrides_the_defaults(checkout):
    (checkout / "deploy" / ".env").write_text(
        "RLPIPE_ENV=prod\nADMIN_BIND_ADDRESS=0.0.0.0\nADMIN_ALLOWED_SOURCES=10.1.0.0/16\nRLPIPE_ADMIN_TOKEN=mine\n"
    )
    services = rendered(checkout)["services"]
    trainer = services["trainer"]
    assert trainer["environment"]["RLPIPE_ENV"] == "prod"
    assert trainer["environment"]["RLPIPE_ADMIN__ALLOWED_SOURCES"] == "10.1.0.0/16"
    assert [port["host_ip"] for port in trainer["ports"]] == ["0.0.0.0"]
    assert any(volume["source"].endswith("/deploy/config/prod.yaml") for volume in trainer["volumes"])
    # Handed to the containers too (env_file): a token chosen here serves the trainer and the cli, never a stage.
    assert "mine" not in json.dumps(services["reward"])


def test_the_gpu_profile_puts_the_trainer_rollouts_and_reference_each_on_an_nvidia_gpu(checkout):
    services = rendered(checkout, "--profile", "gpu")["services"]
    assert set(services) == ALWAYS | {f"{role}-gpu" for role in GPU_ROLES}
    for role in GPU_ROLES:
        devices = services[f"{role}-gpu"]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"capabilities": ["gpu"], "driver": "nvidia", "count": 1}], role
    assert not services["reward"].get("deploy", {}).get("resources")
