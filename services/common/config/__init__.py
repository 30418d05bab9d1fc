"""The one typed configuration of a run, shared by every service.

Loaded from YAML, then overridden by environment variables named
``RLPIPE_<SECTION>__<FIELD>`` (for example ``RLPIPE_TRAIN__LEARNING_RATE=1e-5``).
Environment variables win over the file so that a deployment can change a value
without editing the file. Every value is validated when a service starts; a bad
one stops it with the field's dotted name and what is allowed. Every field, its
unit, default and bounds: docs/configuration.md, generated from these models by
``python -m services.common.config.reference``.

One module per concern: ``base`` (the section base and error type); the section
models by what they configure: ``model`` (model, LoRA, data), ``generation``
(sampling, rollout and its environments), ``scoring`` (reward, reference),
``training`` (train, KL, clipping, TIS, critic, trainer), ``transport``
(checkpoint storage, NATS, weight sync), ``operations`` (service, admin,
telemetry, cost, supervision); ``sections`` (``RunConfig``, the credentials and
build info), ``alerts`` (alert rules and their defaults), ``loading`` (YAML,
environment and dotted overrides), ``live`` (what a running service may change),
``redaction`` (what operators and files may see) and ``reference`` (the generated
reference). Import from this package; the modules are its layout, not its interface.
"""

from services.common.config.alerts import AlertAction, AlertCondition, AlertRule, AlertsConfig, default_alert_rules
from services.common.config.base import ENV_PREFIX, SECRETS_DIRS, ConfigError, Section
from services.common.config.generation import HfEngineConfig, RolloutConfig, SamplingConfig
from services.common.config.live import (
    DEPLOY_TIME_FIELDS,
    LIVE_FIELDS,
    SECURITY_FIELDS,
    is_live,
    refuse_unsafe_live_change,
)
from services.common.config.loading import (
    apply_overrides,
    load_config,
    load_config_with,
    parse_overrides,
    parse_value,
)
from services.common.config.model import DataColumns, DataConfig, LoraConfig, ModelConfig
from services.common.config.operations import (
    AdminConfig,
    CostConfig,
    ServiceConfig,
    SupervisionConfig,
    TelemetryConfig,
)
from services.common.config.redaction import REDACTED, SECRET_FIELDS, redact, redacted_dump
from services.common.config.scoring import (
    OverlongPenaltyConfig,
    ReferenceConfig,
    RewardConfig,
    RewardHttpConfig,
    RewardModelConfig,
)
from services.common.config.sections import (
    AdminCredentials,
    BuildInfo,
    DeploymentEnvironment,
    RunConfig,
    S3Credentials,
    WeightSyncCredentials,
)
from services.common.config.training import ClipConfig, CriticConfig, KLConfig, TISConfig, TrainConfig, TrainerConfig
from services.common.config.transport import CheckpointConfig, NatsConfig, WeightSyncConfig

__all__ = [
    "DEPLOY_TIME_FIELDS",
    "ENV_PREFIX",
    "LIVE_FIELDS",
    "REDACTED",
    "SECRETS_DIRS",
    "SECRET_FIELDS",
    "SECURITY_FIELDS",
    "AdminConfig",
    "AdminCredentials",
    "AlertAction",
    "AlertCondition",
    "AlertRule",
    "AlertsConfig",
    "BuildInfo",
    "CheckpointConfig",
    "ClipConfig",
    "ConfigError",
    "CostConfig",
    "CriticConfig",
    "DataColumns",
    "DataConfig",
    "DeploymentEnvironment",
    "HfEngineConfig",
    "KLConfig",
    "LoraConfig",
    "ModelConfig",
    "NatsConfig",
    "OverlongPenaltyConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RewardHttpConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "S3Credentials",
    "SamplingConfig",
    "Section",
    "ServiceConfig",
    "SupervisionConfig",
    "TISConfig",
    "TelemetryConfig",
    "TrainConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "WeightSyncCredentials",
    "apply_overrides",
    "default_alert_rules",
    "is_live",
    "load_config",
    "load_config_with",
    "parse_overrides",
    "parse_value",
    "redact",
    "redacted_dump",
    "refuse_unsafe_live_change",
]
