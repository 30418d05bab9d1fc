"""The run config that holds every section, the credentials read only from the environment, and build info.

The sections themselves live by concern: ``model``, ``generation``, ``scoring``, ``training``, ``transport``
and ``operations``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from services.common import registry
from services.common.config.alerts import AlertsConfig
from services.common.config.base import ENV_PREFIX, SECRETS_DIRS, DeployTime, Security, one_of, read_environment
from services.common.config.generation import RolloutConfig, SamplingConfig
from services.common.config.model import DataConfig, ModelConfig
from services.common.config.operations import (
    AdminConfig,
    CostConfig,
    Role,
    ServiceConfig,
    SupervisionConfig,
    TelemetryConfig,
)
from services.common.config.scoring import ReferenceConfig, RewardConfig
from services.common.config.tokens import TokenError, read_token_file
from services.common.config.training import TrainConfig, TrainerConfig
from services.common.config.transport import CheckpointConfig, NatsConfig, WeightSyncConfig


class S3Credentials(BaseSettings):
    """Read only from the environment or a secrets file, never from YAML, never logged."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_S3_", extra="ignore", secrets_dir=SECRETS_DIRS)
    access_key: str = Field(default="", repr=False, description="S3 access key id (RLPIPE_S3_ACCESS_KEY)")
    secret_key: str = Field(default="", repr=False, description="S3 secret access key (RLPIPE_S3_SECRET_KEY)")


class ModelCredentials(BaseSettings):
    """What a fetch of model.path (s3:// or hf://) signs with; only from the environment or a secrets file."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_MODEL_", extra="ignore", secrets_dir=SECRETS_DIRS)
    s3_access_key: str = Field(
        default="",
        repr=False,
        description="S3 access key id for an s3:// model (RLPIPE_MODEL_S3_ACCESS_KEY); empty = RLPIPE_S3_ACCESS_KEY",
    )
    s3_secret_key: str = Field(
        default="", repr=False, description="its secret key (RLPIPE_MODEL_S3_SECRET_KEY); empty = RLPIPE_S3_SECRET_KEY"
    )
    hub_token: str = Field(
        default="",
        repr=False,
        description="bearer token for model.fetch.hub_endpoint (RLPIPE_MODEL_HUB_TOKEN); empty = none",
    )


class AdminCredentials(BaseSettings):
    """The admin bearer tokens, only from the environment, a secrets file or admin.token_file and
    admin.read_token_file, never from YAML."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_ADMIN_", extra="ignore", secrets_dir=SECRETS_DIRS)
    token: str = Field(
        default="", repr=False, description="the admin bearer token (RLPIPE_ADMIN_TOKEN); empty = admin.token_file"
    )
    read_token: str = Field(
        default="",
        repr=False,
        description="the read-only bearer token (RLPIPE_ADMIN_READ_TOKEN), which may make only the Admin calls that "
        "read; empty = admin.read_token_file",
    )


def _token_or_nothing(path: Path | None, field: str) -> str:
    """The token in ``path``, or "" when there is none to compare: a missing, unreadable or malformed file is named
    by AdminConfig's check that it exists and by the start checks (services/common/startup_checks/tokens.py)."""
    if path is None:
        return ""
    try:
        return read_token_file(path, field)
    except TokenError:
        return ""


class WeightSyncCredentials(BaseSettings):
    """The run's weight-sync token, only from the environment or a secrets file, never from YAML: the trainer and
    the rollouts hold it, the other roles do not."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_WEIGHTSYNC_", extra="ignore", secrets_dir=SECRETS_DIRS)
    token: str = Field(
        default="",
        repr=False,
        description="bearer token every WeightSync call must carry (RLPIPE_WEIGHTSYNC_TOKEN); empty = the port is "
        "open (refused in prod)",
    )


class RunsLocation(BaseSettings):
    """Where an operator's commands look for local runs when no run directory is named: the environment's
    RLPIPE_RUNS_DIR, the same variable that sets a run's ``runs_dir``, else ``runs``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")
    runs_dir: Path = Field(default=Path("runs"), description="folder of run directories (RLPIPE_RUNS_DIR)")


class RunConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid")

    run_id: DeployTime[str] = Field(
        default="run",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="names the run's streams, buckets, checkpoint prefix and run directory (1-64 letters, digits, "
        "_ or -)",
    )
    environment: DeployTime[Literal["dev", "test", "prod"] | None] = Field(
        default=None, description="the deployment this config is for; a run refuses it when RLPIPE_ENV names another"
    )
    runs_dir: Security[Path] = Field(
        default=Path("runs"),
        description="folder of run directories (logs, metrics, samples; file:// checkpoints by default)",
    )
    metrics_path: Security[Path | None] = Field(
        default=None, description="defaults to <runs_dir>/<run_id>/metrics.jsonl"
    )
    model: ModelConfig = Field(description="the policy model")
    data: DataConfig = Field(description="the prompts to train and evaluate on")
    sampling: SamplingConfig = Field(default=SamplingConfig(), description="how rollouts sample completions")
    train: TrainConfig = Field(default=TrainConfig(), description="the learning algorithm and its optimizer")
    checkpoint: CheckpointConfig = Field(
        default=CheckpointConfig(), description="where and how often checkpoints are kept"
    )
    nats: NatsConfig = Field(default=NatsConfig(), description="the broker and its streams")
    rollout: RolloutConfig = Field(default=RolloutConfig(), description="the rollout role and its engine")
    reward: RewardConfig = Field(
        default=RewardConfig(), description="the reward role: functions, a model, a remote service"
    )
    reference: ReferenceConfig = Field(default=ReferenceConfig(), description="the reference role")
    service: ServiceConfig = Field(default=ServiceConfig(), description="ports, hosts and logs every service shares")
    trainer: TrainerConfig = Field(default=TrainerConfig(), description="the trainer's processes")
    supervision: SupervisionConfig = Field(
        default=SupervisionConfig(), description="how `rlpipe run` restarts and stops services"
    )
    admin: AdminConfig = Field(default=AdminConfig(), description="the trainer's Admin gRPC API")
    weight_sync: WeightSyncConfig = Field(
        default=WeightSyncConfig(),
        description="TLS of the trainer's WeightSync port (its token: RLPIPE_WEIGHTSYNC_TOKEN)",
    )
    telemetry: TelemetryConfig = Field(default=TelemetryConfig(), description="metrics endpoints, files and trackers")
    alerts: AlertsConfig = Field(default=AlertsConfig(), description="alert rules and where firings go")
    cost: CostConfig = Field(default=CostConfig(), description="prices per device-hour, for the run's cost lines")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML arrives as init kwargs; the environment must override it.
        return (env_settings, init_settings) if read_environment.get() else (init_settings,)

    @model_validator(mode="after")
    def _read_token_is_not_the_admin_token(self) -> RunConfig:
        # The same token twice would give every holder of the "read-only" one the power to pause, roll back and stop.
        # Skipped while a live override is validated: the token files and the environment are the deployment's.
        if not read_environment.get():
            return self
        credentials = AdminCredentials()
        read = credentials.read_token or _token_or_nothing(self.admin.read_token_file, "admin.read_token_file")
        if not read:
            return self
        if read == (credentials.token or _token_or_nothing(self.admin.token_file, "admin.token_file")):
            source = (
                "RLPIPE_ADMIN_READ_TOKEN"
                if credentials.read_token
                else f"admin.read_token_file: the token in {str(self.admin.read_token_file)!r}"
            )
            raise ValueError(
                f"{source} is the admin token: a read-only token must be one of its own "
                "(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        return self

    @model_validator(mode="after")
    def _lost_only_after_every_delivery(self) -> RunConfig:
        # A group a stage may still legitimately redeliver must not be written off as lost.
        retrying_s = self.nats.ack_wait_s * self.nats.max_deliver
        if self.train.lost_after_s <= retrying_s:
            raise ValueError(
                f"train.lost_after_s ({self.train.lost_after_s}) must exceed nats.ack_wait_s x nats.max_deliver "
                f"({retrying_s}): a group that stages still retry would be recorded as lost"
            )
        return self

    @model_validator(mode="after")
    def _prod_runs_model_code_boxed(self) -> RunConfig:
        # Unboxed, the code reads the rollout's environment through /proc: the weight-sync token and the store's keys.
        if self.environment == "prod" and self.rollout.python_tool_isolation == "allow_unisolated":
            raise ValueError(
                "rollout.python_tool_isolation: allow_unisolated is refused in a prod deployment: model-written code "
                "would run unboxed beside the run's credentials; run the rollout where a box can be built "
                '(docs/agents.md, "The box")'
            )
        return self

    @model_validator(mode="after")
    def _deterministic_runs_have_one_of_each(self) -> RunConfig:
        # Two replicas of a role share its queue by whoever pulls first, and two trainer processes reduce gradients
        # across processes (not verified to be reproducible): either would make a run depend on timing.
        if not self.train.deterministic:
            return self
        several = {
            "rollout.replicas": self.rollout.replicas,
            "reward.replicas": self.reward.replicas,
            "reference.replicas": self.reference.replicas,
            "trainer.nproc": self.trainer.nproc,
        }
        problems = [f"{name} is {count}" for name, count in several.items() if count > 1]
        if problems:
            raise ValueError(
                f"train.deterministic needs one process of every role, and {', '.join(problems)}: set them to 1 or "
                "train.deterministic: false"
            )
        return self

    @model_validator(mode="after")
    def _reference_passes_hold_a_sequence(self) -> RunConfig:
        budget, longest = self.reference.micro_batch_tokens, self.train.max_seq_len
        if budget is not None and budget < longest:
            raise ValueError(
                f"reference.micro_batch_tokens ({budget}) is smaller than one sequence of train.max_seq_len "
                f"({longest}) tokens: set it to at least {longest}, or null"
            )
        return self

    @model_validator(mode="after")
    def _episodes_waited_on_within_the_work_limit(self) -> RunConfig:
        # A batch's episodes may each wait on the environment at its reset and every turn, each call up to its
        # timeout on every try: a batch that waits past nats.max_work_s is abandoned and, after max_deliver tries,
        # dead-lettered as a timeout, which would blame the prompts for a slow environment.
        r = self.rollout
        if not r.multi_turn:
            return self
        tries = r.environment_retries + 1 if r.environment_url else 1
        waited_s = (r.max_turns + 1) * tries * r.environment_timeout_s
        if waited_s >= self.nats.max_work_s:
            raise ValueError(
                f"an episode may wait on its environment (rollout.max_turns + 1) x tries x "
                f"rollout.environment_timeout_s = {r.max_turns + 1} x {tries} x {r.environment_timeout_s:g} = "
                f"{waited_s:g}s, not below nats.max_work_s ({self.nats.max_work_s:g}s): a slow environment would get "
                "batches dead-lettered as timeouts; raise nats.max_work_s or lower those"
            )
        return self

    @model_validator(mode="after")
    def _episodes_evaluated_by_a_rule(self) -> RunConfig:
        # A multi-turn run's held-out episodes are scored by reward.functions and the environment's reward
        # (docs/agents.md): with no positive weight no episode could count as right, so the run would report 0
        # whatever the model does.
        r = self.reward
        scored = any(w > 0 for w in r.functions.values()) or r.environment_weight > 0
        if self.rollout.multi_turn and self.data.eval_path and not scored:
            raise ValueError(
                "a multi-turn run's held-out evaluation scores episodes with reward.functions and "
                "reward.environment_weight, none of which has a positive weight here: name one (such as "
                "final_number: 1.0) or leave data.eval_path empty"
            )
        if r.environment_weight and not self.rollout.multi_turn:
            raise ValueError(
                f"reward.environment_weight={r.environment_weight:g} weighs an environment's reward, and this run "
                "has no environment: set rollout.environment or rollout.environment_url, or leave it 0"
            )
        return self

    @model_validator(mode="after")
    def _gpu_shares_fit_one_gpu(self) -> RunConfig:
        # Shares are of one GPU that the named roles' processes share: together they cannot claim more than all of
        # it. vLLM takes its share as rollout.gpu_memory_utilization, which a rollout's share therefore replaces
        # (every reload of a dumped config sees both, so the share must win rather than conflict).
        shares, rollout = self.service.gpu_memory_fraction, self.rollout
        if "rollout" in shares and rollout.backend == "vllm":
            rollout.gpu_memory_utilization = shares["rollout"]
        replicas: dict[Role, int] = {
            "trainer": 1,
            "reference": self.reference.replicas,
            "reward": self.reward.replicas,
            "rollout": rollout.replicas if isinstance(rollout.replicas, int) else 0,  # auto: the launcher's count
        }
        terms: dict[Role, float] = {role: shares[role] * count for role, count in replicas.items() if role in shares}
        if sum(terms.values()) > 1 + 1e-9:
            said = " + ".join(f"{role} {shares[role]:g} x {replicas[role]}" for role in terms)
            raise ValueError(
                f"service.gpu_memory_fraction: the processes sharing one GPU would take {sum(terms.values()):.3f} of "
                f"its memory ({said}); at most 1: lower a share or a role's replicas"
            )
        if rollout.replicas == "auto":
            if self.trainer.nproc > 1:
                raise ValueError(
                    f"rollout.replicas: auto places every role on one GPU, and trainer.nproc {self.trainer.nproc} "
                    "wants a GPU per trainer process: give rollout.replicas a count"
                )
            if rollout.tensor_parallel_size > 1:
                raise ValueError(
                    f"rollout.replicas: auto places every role on one GPU, and rollout.tensor_parallel_size "
                    f"{rollout.tensor_parallel_size} shards each engine over several: give rollout.replicas a count"
                )
        return self

    @field_validator("reward")
    @classmethod
    def _known_reward_functions(cls, reward: RewardConfig) -> RewardConfig:
        for name in reward.functions:
            if ":" not in name:  # import paths are checked by RewardConfig
                one_of(name, registry.REWARD_FUNCTIONS.names())
        return reward

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run_id

    @property
    def metrics_file(self) -> Path:
        return self.metrics_path or self.run_dir / "metrics.jsonl"

    @property
    def checkpoint_url(self) -> str:
        return self.checkpoint.store_url or self.runs_dir.resolve().as_uri()

    @property
    def reference_model_path(self) -> Path:
        return self.reference.model_path or self.model.folder

    @property
    def trainer_address(self) -> str:
        return f"{self.service.trainer_host or self.service.host}:{self.service.trainer_grpc_port}"


class BuildInfo(BaseSettings):
    """What is running: baked into images as RLPIPE_BUILD_VERSION / RLPIPE_BUILD_REVISION, reported by status."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_BUILD_", extra="ignore")
    version: str = Field(default="", description="the package version; empty = the installed rlpipe's")
    revision: str = Field(default="", description="the source revision; empty = the git checkout's short hash")

    def resolved(self) -> BuildInfo:
        """Fill what the environment left empty from the installed package and the git checkout."""
        import importlib.metadata
        import subprocess

        version = self.version or importlib.metadata.version("rlpipe")
        revision = self.revision
        if not revision:
            try:
                revision = subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                    cwd=Path(__file__).parent,
                ).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                revision = ""
        return BuildInfo(version=version, revision=revision or "unknown")


class DeploymentEnvironment(BaseSettings):
    """``RLPIPE_ENV``: which deployment this machine belongs to (dev, test or prod)."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_", extra="ignore")
    env: str = Field(default="", description="this machine's deployment (dev, test or prod); empty = any")
