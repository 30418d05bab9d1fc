"""What of a config files, logs and operators may see."""

from __future__ import annotations

import re
from typing import Any

from services.common.config.sections import RunConfig

REDACTED = "<redacted>"
# Credentials never enter the model; a webhook URL often carries a token in its path.
SECRET_FIELDS = ("alerts.webhook_url",)

# A URL in a text: scheme://, then anything up to whitespace or a quote.
_URL = re.compile(r"""[A-Za-z][A-Za-z0-9+.-]*://[^\s'"<>`]+""")
# scheme://user:PASSWORD@host, up to the authority's last "@" (so a password holding an unencoded "@" goes whole),
# or scheme://TOKEN@host (NATS token auth, a Git token as the user name): the user name alone is a secret there.
_PASSWORD = re.compile(r"^([^:/?#]+://[^/?#@:]*):[^/?#]*@")
_TOKEN_USER = re.compile(r"^((?!hf://)[^:/?#]+://)[^/?#@:]+@")  # not hf://repo@revision, a model's address
_QUERY_VALUE = re.compile(r"([?&][^=&#]+=)[^&#]+")  # ?key=VALUE&key=VALUE


def hide_url_secrets(text: str) -> str:
    """``text`` with each URL's password (``scheme://user:<redacted>@host``; a user name without a password, often a
    token, as ``scheme://<redacted>@host``) and query values
    (``?token=<redacted>``) hidden: a database, tracker, broker or HTTP service URL often carries its credentials,
    and whatever text quotes one (a log line, an event, a config error, a dead letter's reason) must not."""
    if "://" not in text:
        return text

    def hidden(url: re.Match[str]) -> str:
        shown = _PASSWORD.sub(rf"\1:{REDACTED}@", url.group(0))
        shown = _TOKEN_USER.sub(rf"\1{REDACTED}@", shown)
        return _QUERY_VALUE.sub(rf"\1{REDACTED}", shown)

    return _URL.sub(hidden, text)


def redact(key: str, value: Any) -> Any:
    """``value`` of the dotted field ``key`` ("" for the whole config) as files, logs and operators may see it."""
    if key in SECRET_FIELDS:
        return REDACTED if value else value
    if isinstance(value, dict):
        return {name: redact(f"{key}.{name}" if key else name, item) for name, item in value.items()}
    if isinstance(value, list):
        return [redact(key, item) for item in value]
    if isinstance(value, str):
        return hide_url_secrets(value)
    return value


def redacted_dump(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data for files and operators."""
    return redact("", cfg.model_dump(mode="json", by_alias=True))
