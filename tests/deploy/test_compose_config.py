"""`docker compose config` (Compose v2, deploy/install-compose.sh) on the root compose.yaml, run where an operator
runs `docker compose up`: the include of deploy/compose.yaml, deploy/.env's secrets, ./.env's profile. It reads files
only, so no Docker engine is needed; a copy of the files is rendered, with a deploy/.env written as operations.md
says (from deploy/.env.example, secrets filled)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT
from tests.deploy.test_compose import ALWAYS, GPU_ROLES

pytestmark = pytest.mark.integration

# Where deploy/install-compose.sh (run by `make install` and .ci/run) puts Compose.
PINNED_COMPOSE = ROOT / "build" / "tools" / "bin" / "docker-compose"
SECRETS = {
    "MINIO_ROOT_USER": "rlpipe-operator",
    "MINIO_ROOT_PASSWORD": "a-long-test-password",
    "RLPIPE_ADMIN_TOKEN": "t",
}


def docker_compose() -> str:
    if not PINNED_COMPOSE.is_file():
        pytest.fail("no docker-compose: run `sh deploy/install-compose.sh` (`make install` does)")
    return str(PINNED_COMPOSE)


def write_env(folder: Path, secrets: dict[str, str]) -> None:
    lines = []
    for line in (ROOT / "deploy" / ".env.example").read_text().splitlines():
        name = line.split("=", 1)[0]
        lines.append(f"{name}={secrets[name]}" if name in secrets else line)
    (folder / "deploy" / ".env").write_text("\n".join(lines) + "\n")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The root compose.yaml, ./.env and deploy/ as a clone has them, plus the operator's deploy/.env."""
    shutil.copy(ROOT / "compose.yaml", tmp_path)
    shutil.copy(ROOT / ".env", tmp_path)
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy", ignore=shutil.ignore_patterns(".env"))
    write_env(tmp_path, SECRETS)
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


def test_docker_compose_up_from_the_root_runs_the_cpu_profile_with_the_secrets_of_deploy_env(checkout):
    services = rendered(checkout)["services"]
    assert set(services) == ALWAYS | set(GPU_ROLES)
    assert all("deploy" not in service or not service["deploy"].get("resources") for service in services.values())
    assert services["rollout"]["environment"]["RLPIPE_ROLLOUT__BACKEND"] == "hf"
    minio = services["minio"]["environment"]
    assert (minio["MINIO_ROOT_USER"], minio["MINIO_ROOT_PASSWORD"]) == (
        SECRETS["MINIO_ROOT_USER"],
        SECRETS["MINIO_ROOT_PASSWORD"],
    )


def test_the_gpu_profile_puts_the_trainer_rollouts_and_reference_each_on_an_nvidia_gpu(checkout):
    services = rendered(checkout, "--profile", "gpu")["services"]
    assert set(services) == ALWAYS | {f"{role}-gpu" for role in GPU_ROLES}
    for role in GPU_ROLES:
        devices = services[f"{role}-gpu"]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"capabilities": ["gpu"], "driver": "nvidia", "count": 1}], role
    assert not services["reward"].get("deploy", {}).get("resources")


def test_a_secret_left_empty_stops_compose_naming_it_and_the_file_to_set_it_in(checkout):
    write_env(checkout, {**SECRETS, "MINIO_ROOT_PASSWORD": ""})
    done = compose_config(checkout)
    assert done.returncode != 0
    assert "MINIO_ROOT_PASSWORD" in done.stderr
    assert "deploy/.env" in done.stderr
