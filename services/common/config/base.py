"""What every config model shares: the strict section base, the environment switch and the error type."""

from __future__ import annotations

import contextvars
from pathlib import Path

from pydantic import BaseModel, ConfigDict

ENV_PREFIX = "RLPIPE_"
# Off while a live override is validated, so the environment cannot undo an operator's change.
read_environment = contextvars.ContextVar("read_environment", default=True)


# Docker and Kubernetes secrets mounted as files, one per variable: /run/secrets/RLPIPE_S3_ACCESS_KEY and so on.
SECRETS_DIRS = [folder for folder in ("/run/secrets",) if Path(folder).is_dir()] or None


class Section(BaseModel):
    # Every float of every section is finite: YAML reads .inf and .nan, and pydantic would take them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def one_of(name: str, allowed: list[str]) -> str:
    if name not in allowed:
        raise ValueError(f"{name!r} is not one of {allowed}")
    return name


class ConfigError(ValueError):
    """A configuration that cannot start a run; the message names every bad field."""
