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
environment and dotted overrides), ``live`` (what a running service may change, from
the change class each field's annotation carries: ``base.Change``),
``redaction`` (what operators and files may see), ``tokens`` (credentials that can go
into a request header, checked without quoting them) and ``reference`` (the generated
reference). Import from this package; the modules are its layout, not its interface.
"""

from services.common.config.alerts import AlertAction, AlertCondition, AlertRule, AlertsConfig, default_alert_rules
from services.common.config.base import ENV_PREFIX, SECRETS_DIRS, Change, ConfigError, Section
from services.common.config.generation import HfEngineConfig, RolloutConfig, SamplingConfig
from services.common.config.live import (
    change_class,
    classes_under,
    field_classes,
    fields_of,
    is_live,
    leaf_fields,
    refuse_fixed_changes,
    refuse_unsafe_live_change,
)
from services.common.config.loading import (
    apply_overrides,
    load_config,
    load_config_with,
    parse_overrides,
    parse_value,
)
from services.common.config.model import DataColumns, DataConfig, LoraConfig, ModelConfig, ModelFetchConfig
from services.common.config.operations import (
    AdminConfig,
    CostConfig,
    Role,
    ServiceConfig,
    SupervisionConfig,
    TelemetryConfig,
)
from services.common.config.redaction import REDACTED, SECRET_FIELDS, hide_url_secrets, redact, redacted_dump
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
    ModelCredentials,
    RunConfig,
    RunsLocation,
    S3Credentials,
    WeightSyncCredentials,
)
from services.common.config.tokens import TokenError, header_value_problem, read_token_file, token_problem
from services.common.config.training import ClipConfig, CriticConfig, KLConfig, TISConfig, TrainConfig, TrainerConfig
from services.common.config.transport import CheckpointConfig, NatsConfig, WeightSyncConfig

__all__ = [
    "ENV_PREFIX",
    "REDACTED",
    "SECRETS_DIRS",
    "SECRET_FIELDS",
    "AdminConfig",
    "AdminCredentials",
    "AlertAction",
    "AlertCondition",
    "AlertRule",
    "AlertsConfig",
    "BuildInfo",
    "Change",
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
    "ModelCredentials",
    "ModelFetchConfig",
    "NatsConfig",
    "OverlongPenaltyConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RewardHttpConfig",
    "RewardModelConfig",
    "Role",
    "RolloutConfig",
    "RunConfig",
    "RunsLocation",
    "S3Credentials",
    "SamplingConfig",
    "Section",
    "ServiceConfig",
    "SupervisionConfig",
    "TISConfig",
    "TelemetryConfig",
    "TokenError",
    "TrainConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "WeightSyncCredentials",
    "apply_overrides",
    "change_class",
    "classes_under",
    "default_alert_rules",
    "field_classes",
    "fields_of",
    "header_value_problem",
    "hide_url_secrets",
    "is_live",
    "leaf_fields",
    "load_config",
    "load_config_with",
    "parse_overrides",
    "parse_value",
    "read_token_file",
    "redact",
    "redacted_dump",
    "refuse_fixed_changes",
    "refuse_unsafe_live_change",
    "token_problem",
]
