"""The per-environment configs, and every RLPIPE_* name the deploy files and docs use.

deploy/config/{dev,test,prod}.yaml are complete files (usable as they are) that may differ from
base.yaml only in ALLOWED; each must load through load_config like a service loads it. Every
RLPIPE_<SECTION>__<FIELD> written in compose, k8s, .env.example, the Dockerfile or the docs must
name a field of RunConfig, so renaming a field without updating them fails here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from services.common.config import (
    AdminCredentials,
    BuildInfo,
    ConfigError,
    DeploymentEnvironment,
    ModelCredentials,
    RunConfig,
    S3Credentials,
    WeightSyncCredentials,
    load_config,
)
from services.tuner.cli import STORAGE_ENVVAR
from tests.support.deploy import DEPLOY, find, load_yaml
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration

ENVIRONMENTS = ("dev", "test", "prod")
# What an environment may change relative to base.yaml: identity, broker durability and timing,
# run length, retention, logging and where alerts go. Anything else belongs in base.yaml.
ALLOWED = {
    "environment",
    "nats.storage",
    "nats.sync_always",
    "nats.stream_replicas",
    "nats.ack_wait_s",
    "nats.max_deliver",
    "nats.duplicate_window_s",
    "train.total_steps",
    "checkpoint.save_every_steps",
    "checkpoint.keep_last",
    "checkpoint.s3_secure",
    "checkpoint.mirror_url",
    "service.log_level",
    "alerts.webhook_url",
}
# Production also trains a real model (SmolLM2-135M-Instruct, bfloat16) where the others train the tiny demo model:
# the model, its data and reward, and what `rlpipe plan` sized for it (docs/operations.md, "Sizing").
PROD_MODEL = {
    "model.path",
    "model.dtype",
    "data.task_name",
    "data.train_path",
    "data.eval_path",
    "sampling.temperature",
    "sampling.max_new_tokens",
    "train.learning_rate",
    "train.max_seq_len",
    "train.micro_batch_tokens",
    "reference.batch",
    "rollout.kv_cache_mib",
    "reward.functions",
}
ENV_NAME = re.compile(r"\bRLPIPE_[A-Z0-9_]+\b")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No RLPIPE_* from the machine running the tests leaks into a load."""
    for name in list(os.environ):
        if name.startswith("RLPIPE_"):
            monkeypatch.delenv(name)
    return monkeypatch


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def load_with_test_model(path: Path, tiny_model: tuple[Path, Path]) -> RunConfig:
    """load_config as a service runs it, with the container's model and data paths pointed at the test model."""
    model_dir, data_dir = tiny_model
    raw = load_yaml(path)
    return load_config(
        path,
        model={**raw["model"], "path": str(model_dir)},
        data={**raw["data"], "train_path": str(data_dir / "train.jsonl"), "eval_path": str(data_dir / "eval.jsonl")},
    )


def run_configs() -> list[Path]:
    # kustomization.yaml beside them turns the same files into a ConfigMap for deploy/k8s.
    return [p for p in sorted((DEPLOY / "config").glob("*.yaml")) if p.name != "kustomization.yaml"]


@pytest.mark.unit
def test_the_config_folder_holds_base_and_one_file_per_environment():
    assert sorted(p.stem for p in run_configs()) == sorted(["base", *ENVIRONMENTS])
    kustomization = load_yaml(DEPLOY / "config" / "kustomization.yaml")
    assert sorted(kustomization["configMapGenerator"][0]["files"]) == sorted(p.name for p in run_configs())


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_environment_config_loads_for_its_environment(env, tiny_model, clean_env):
    clean_env.setenv("RLPIPE_ENV", env)
    cfg = load_with_test_model(DEPLOY / "config" / f"{env}.yaml", tiny_model)
    assert cfg.environment == env
    # The model itself re-checks this; a config that loads has a safe window.
    assert cfg.nats.duplicate_window_s > cfg.nats.ack_wait_s * cfg.nats.max_deliver


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_environment_config_is_refused_elsewhere(env, tiny_model, clean_env):
    clean_env.setenv("RLPIPE_ENV", next(other for other in ENVIRONMENTS if other != env))
    with pytest.raises(ConfigError, match="RLPIPE_ENV"):
        load_with_test_model(DEPLOY / "config" / f"{env}.yaml", tiny_model)


def test_base_config_loads_and_belongs_to_no_environment(tiny_model, clean_env):
    assert load_with_test_model(DEPLOY / "config" / "base.yaml", tiny_model).environment is None


@pytest.mark.unit
@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_environment_config_differs_from_base_only_where_allowed(env):
    base = flatten(load_yaml(DEPLOY / "config" / "base.yaml"))
    config = flatten(load_yaml(DEPLOY / "config" / f"{env}.yaml"))
    changed = {key for key in base.keys() | config.keys() if base.get(key, "<absent>") != config.get(key, "<absent>")}
    allowed = ALLOWED | (PROD_MODEL if env == "prod" else set())
    outside = {key for key in changed if not any(key == a or key.startswith(f"{a}.") for a in allowed)}
    assert outside == set(), f"{env}.yaml changes fields that belong in base.yaml"
    assert "environment" in changed


@pytest.mark.unit
def test_production_trains_smollm2_in_bfloat16_with_the_sizes_the_operations_guide_shows():
    prod = flatten(load_yaml(DEPLOY / "config" / "prod.yaml"))
    assert (prod["model.path"], prod["model.dtype"]) == ("/models/smollm2-135m-instruct", "bfloat16")
    assert prod["rollout.kv_cache_mib"] is None  # a GPU of its own: vLLM's cache takes what the share leaves
    guide = (ROOT / "docs" / "operations.md").read_text()
    plan = guide[guide.index("rlpipe plan deploy/config/prod.yaml") :]
    assert f"{prod['train.micro_batch_tokens']} micro-batch tokens, sequences of {prod['train.max_seq_len']}" in plan


def test_production_broker_is_durable(tiny_model, clean_env):
    clean_env.setenv("RLPIPE_ENV", "prod")
    cfg = load_with_test_model(DEPLOY / "config" / "prod.yaml", tiny_model)
    assert cfg.nats.storage == "file"
    assert cfg.nats.sync_always is True


def test_production_mirrors_every_checkpoint_into_another_bucket(tiny_model, clean_env):
    clean_env.setenv("RLPIPE_ENV", "prod")
    cfg = load_with_test_model(DEPLOY / "config" / "prod.yaml", tiny_model)
    store_bucket = cfg.checkpoint.store_url.removeprefix("s3://").partition("/")[0]
    mirror_bucket = cfg.checkpoint.mirror_url.removeprefix("s3://").partition("/")[0]
    assert cfg.checkpoint.mirror_url.startswith("s3://") and mirror_bucket != store_bucket


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_a_stalled_role_exits_so_a_restart_policy_can_act(env, tiny_model, clean_env):
    # Compose restarts on exit only (never an unhealthy container); the liveness probe (20 s x 3) acts first on k8s.
    clean_env.setenv("RLPIPE_ENV", env)
    cfg = load_with_test_model(DEPLOY / "config" / f"{env}.yaml", tiny_model)
    assert 60 < cfg.service.exit_when_stalled_s <= 600


@pytest.mark.unit
def test_no_secret_is_written_into_a_config():
    secret = re.compile(r"(^|_)(secret|secret_key|access_key|token|password)$")
    for path in run_configs():
        assert not [key for key in flatten(load_yaml(path)) if secret.search(key.rsplit(".", 1)[-1])], path.name


# --- RLPIPE_* names -------------------------------------------------------------------------


def settings_names() -> set[str]:
    """The variables read outside RunConfig: credentials, build info, RLPIPE_ENV and the tuner's storage URL."""
    names = {STORAGE_ENVVAR}
    for settings in (
        S3Credentials,
        ModelCredentials,
        AdminCredentials,
        WeightSyncCredentials,
        BuildInfo,
        DeploymentEnvironment,
    ):
        prefix = settings.model_config["env_prefix"]
        names |= {f"{prefix}{field}".upper() for field in settings.model_fields}
    return names


def resolves(name: str) -> bool:
    """Whether RLPIPE_<A>__<B>... walks to a field of RunConfig (by field name or alias)."""
    model: type[BaseModel] | None = RunConfig
    parts = name.removeprefix("RLPIPE_").lower().split("__")
    for depth, part in enumerate(parts):
        if model is None:
            return False
        fields = {field.alias or key: field for key, field in model.model_fields.items()} | dict(model.model_fields)
        if part not in fields:
            return False
        annotation = fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if model is None and getattr(annotation, "__origin__", None) is dict and depth == len(parts) - 2:
            return True  # a key of a mapping field, e.g. RLPIPE_REWARD__FUNCTIONS__EXACT_MATCH
    return True


def deploy_texts() -> dict[str, str]:
    paths = [
        DEPLOY / "compose.yaml",
        DEPLOY / ".env.example",
        DEPLOY / "Dockerfile",
        *(p for p in (DEPLOY / "k8s").rglob("*") if p.is_file()),
        *(DEPLOY / "config").glob("*.yaml"),
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
    ]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


@pytest.mark.unit
def test_the_name_check_knows_right_from_wrong():
    assert resolves("RLPIPE_TRAIN__KL__COEF") and resolves("RLPIPE_SERVICE__TRAINER_HOST") and resolves("RLPIPE_RUN_ID")
    assert not resolves("RLPIPE_TRAIN__LEARNINGRATE") and not resolves("RLPIPE_SERVICE__TRAINER_GRPC_PORT__X")
    assert {"RLPIPE_S3_ACCESS_KEY", "RLPIPE_ADMIN_TOKEN", "RLPIPE_BUILD_REVISION", "RLPIPE_ENV"} <= settings_names()


@pytest.mark.unit
def test_every_rlpipe_variable_in_deploy_files_and_docs_exists():
    known = settings_names()
    unknown = {
        f"{path}: {name}"
        for path, text in deploy_texts().items()
        for name in ENV_NAME.findall(text)
        if name not in known and not resolves(name)
    }
    assert unknown == set()
    used = {name for text in deploy_texts().values() for name in ENV_NAME.findall(text)}
    assert {"RLPIPE_SERVICE__GRPC_PORT", "RLPIPE_CHECKPOINT__S3_ENDPOINT", "RLPIPE_ADMIN_TOKEN"} <= used


def interpolate(value: Any) -> str:
    """Compose's ${VAR:-default} as the default, as on a host that sets nothing else."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", str(value))


def test_compose_environment_loads_with_its_config(tiny_model, clean_env):
    env = load_yaml(DEPLOY / "compose.yaml")["x-rlpipe-env"]
    for name, value in env.items():
        clean_env.setenv(name, interpolate(value))
    cfg = load_with_test_model(DEPLOY / "config" / f"{interpolate(env['RLPIPE_ENV'])}.yaml", tiny_model)
    assert cfg.trainer_address == "trainer:50051"
    assert (cfg.service.host, cfg.service.grpc_port, cfg.telemetry.metrics_port) == ("0.0.0.0", 50061, 9400)
    assert cfg.checkpoint_url == "s3://rlpipe/checkpoints" and cfg.checkpoint.s3_secure is True  # MinIO over TLS


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_k8s_environment_loads_with_the_config_it_selects(overlay, rendered, tiny_model, clean_env):
    (env_map,) = [cm for cm in find(rendered[overlay], "ConfigMap") if cm["metadata"]["name"].startswith("rlpipe-env")]
    for name, value in env_map["data"].items():
        if name.startswith("RLPIPE_"):
            clean_env.setenv(name, value)
    assert env_map["data"]["RLPIPE_ENV"] == overlay
    cfg = load_with_test_model(DEPLOY / "config" / f"{overlay}.yaml", tiny_model)
    assert cfg.environment == overlay
    assert cfg.trainer_address == "trainer:50051" and cfg.nats.url == "tls://nats:4222"
