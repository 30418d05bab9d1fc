"""What of a config files, logs and operators may see."""

from __future__ import annotations

from typing import Any

from services.common.config.sections import RunConfig

REDACTED = "<redacted>"
# Credentials never enter the model; a webhook URL often carries a token in its path.
SECRET_FIELDS = ("alerts.webhook_url",)


def redact(key: str, value: Any) -> Any:
    """``value`` of the dotted field ``key`` ("" for the whole config) as files, logs and operators may see it."""
    if key in SECRET_FIELDS:
        return REDACTED if value else value
    if isinstance(value, dict):
        return {name: redact(f"{key}.{name}" if key else name, item) for name, item in value.items()}
    return value


def redacted_dump(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data for files and operators."""
    return redact("", cfg.model_dump(mode="json", by_alias=True))
