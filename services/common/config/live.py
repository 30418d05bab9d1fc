"""Which fields a running service may change, and which only where it is deployed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.common.config.base import ConfigError
from services.common.config.loading import dotted_value
from services.common.config.sections import RunConfig

# Fields a running service applies between steps or batches; any other change takes effect at its next start.
LIVE_FIELDS = (
    "train.learning_rate",
    "train.kl.coef",
    "train.entropy_coef",
    "train.clip",
    "train.max_grad_norm",
    "train.max_staleness",
    "train.log_interval",
    "sampling.temperature",
    "sampling.top_p",
    "sampling.max_new_tokens",
    "reward.functions",
    "reward.environment_weight",
    "reward.http.token_file",
    "alerts",
    "checkpoint.save_every_steps",
    "checkpoint.keep_last",
    "data.eval_every_steps",
)
# Fields that say which run and broker a service belongs to: set where it is deployed, never through the admin.
DEPLOY_TIME_FIELDS = ("run_id", "nats.url", "nats.nkey_seed_file", "nats.tls_ca_file")


def is_live(key: str) -> bool:
    return any(key == live or key.startswith(live + ".") for live in LIVE_FIELDS)


# Settings that decide what a run trusts and where its data goes: certificates and credential files, the checkpoint
# stores (and the endpoint their credentials are sent to), the model's source and the hashes it is held to, the
# endpoints prompts, completions, metrics and alert firings leave for.
# An admin token must not be enough to redirect any of them, so they change only where the services are deployed.
SECURITY_FIELDS = (
    "admin.token_file",
    "admin.tls_cert",
    "admin.tls_key",
    "admin.allowed_sources",
    "weight_sync.tls_cert",
    "weight_sync.tls_key",
    "weight_sync.tls_ca",
    "checkpoint.store_url",
    "checkpoint.mirror_url",
    "checkpoint.s3_endpoint",
    "checkpoint.s3_secure",
    "checkpoint.s3_ca_file",
    "model.path",
    "model.sha256",
    "model.manifest",
    "model.fetch.cache_dir",
    "model.fetch.s3_endpoint",
    "model.fetch.s3_secure",
    "model.fetch.hub_download",
    "model.fetch.hub_endpoint",
    "model.fetch.hub_cache_dir",
    "alerts.webhook_url",
    "reward.http.url",
    "reward.http.headers_from_env",
    "telemetry.otlp_endpoint",
    "telemetry.mlflow_tracking_uri",
)
# Settings a change to would not take effect even at the next start without breaking the run: the LoRA adapters'
# shapes decide the optimizer state, the checkpoints and what weight sync sends, so a live change is refused outright.
RESTART_ONLY_FIELDS = ("model.lora",)
# The one setting a live change could name code with: a 'module:function' reward plugin.
PLUGIN_FIELD = "reward.functions"
_UNSET = object()


def _proposed(settings: Mapping[str, Any], field: str) -> Any:
    """What ``settings`` (dotted keys, values that may be whole sections) set ``field`` to; ``_UNSET`` if nothing."""
    found = _UNSET
    for key, value in settings.items():
        if key == field:
            found = value
        elif field.startswith(key + "."):
            node = value
            for part in field.removeprefix(key + ".").split("."):
                node = node.get(part, _UNSET) if isinstance(node, dict) else _UNSET
            found = node if node is not _UNSET else found
    return found


def refuse_unsafe_live_change(started: RunConfig, current: RunConfig, settings: Mapping[str, Any]) -> None:
    """Raise ConfigError, naming the field, if ``settings`` change a security setting or name a new plugin.

    Checked on the raw settings before any validation, because validating a config imports the 'module:function'
    reward plugins it names: a live change must never make the trainer import code. Plugins the run started with
    (``started``, the file and environment config) were imported at start, so a change may still reweight them.
    """
    for field in SECURITY_FIELDS:
        value = _proposed(settings, field)
        if value is not _UNSET and value != dotted_value(current, field):
            raise ConfigError(
                f"invalid configuration:\n  {field}: is not changeable live (a security setting); set it in the "
                "config file or RLPIPE_* environment where the services are deployed, and restart them"
            )
    for field in RESTART_ONLY_FIELDS:
        value = _proposed(settings, field)
        # A key inside the field (model.lora.r) changes it as much as the whole field does.
        inside = [key for key in settings if key.startswith(field + ".")]
        if (value is not _UNSET and value != dotted_value(current, field)) or any(
            settings[key] != dotted_value(current, key) for key in inside
        ):
            raise ConfigError(
                f"invalid configuration:\n  {field}: is restart-only and not changeable live (the adapters' shapes "
                "decide the optimizer state, the checkpoints and what weight sync sends); start a new run with it"
            )
    functions = _proposed(settings, PLUGIN_FIELD)
    if isinstance(functions, dict):
        started_with = started.reward.functions
        new_plugins = sorted(str(name) for name in functions if ":" in str(name) and name not in started_with)
        if new_plugins:
            raise ConfigError(
                f"invalid configuration:\n  {PLUGIN_FIELD}: {new_plugins[0]!r} is a 'module:function' plugin, "
                "imported only when a service starts: name it in the config file and restart; a live change may "
                "name registered functions and reweight the plugins the run started with"
            )
