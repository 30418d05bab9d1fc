"""What every config model shares: the strict section base, the environment switch, the error type, and the change
class every field carries.

Each field says what a change to it does on a running run, by its annotation: ``Live[float]``, ``Restart[int]``,
``Security[Path | None]``... (``Annotated`` metadata: pydantic and type checkers see the plain type). The rules that
act on the class (what ``rlpipe config set`` refuses, what a running service applies at once, the reference's
column) are derived from the fields in ``live.py``; a unit test walks every field and fails on one without a class,
and on an endpoint, host, URL, path, file or token field that is not a security setting.
"""

from __future__ import annotations

import contextvars
from enum import StrEnum
from pathlib import Path
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict

ENV_PREFIX = "RLPIPE_"
# Off while a live override is validated, so the environment cannot undo an operator's change.
read_environment = contextvars.ContextVar("read_environment", default=True)


# Docker and Kubernetes secrets mounted as files, one per variable: /run/secrets/RLPIPE_S3_ACCESS_KEY and so on.
SECRETS_DIRS = [folder for folder in ("/run/secrets",) if Path(folder).is_dir()] or None


class Change(StrEnum):
    """What ``rlpipe config set`` (the admin's UpdateConfig) does with a field on a running run."""

    LIVE = "live"  # applied by the running services between steps or batches
    RESTART = "restart"  # stored, and applied by each service using it at its next start
    NEW_RUN = "new-run"  # refused: what the run has stored (optimizer state, checkpoints) depends on it
    # Refused: where the run's data, prompts, metrics and credentials go, what it trusts, what code it loads. An
    # admin token must not be enough to redirect any of it, so it is set only where the services are deployed.
    SECURITY = "security"
    DEPLOY_TIME = "deploy-time"  # refused: which run and broker a service belongs to (a security setting too)

    @property
    def refused_live(self) -> bool:
        """A change through the admin is refused outright, naming the field."""
        return self in (Change.NEW_RUN, Change.SECURITY, Change.DEPLOY_TIME)

    @property
    def security(self) -> bool:
        """Set where the services are deployed, never through the admin."""
        return self in (Change.SECURITY, Change.DEPLOY_TIME)


T = TypeVar("T")
Live = Annotated[T, Change.LIVE]
Restart = Annotated[T, Change.RESTART]
NewRun = Annotated[T, Change.NEW_RUN]
Security = Annotated[T, Change.SECURITY]
DeployTime = Annotated[T, Change.DEPLOY_TIME]


class Section(BaseModel):
    # Every float of every section is finite: YAML reads .inf and .nan, and pydantic would take them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def one_of(name: str, allowed: list[str]) -> str:
    if name not in allowed:
        raise ValueError(f"{name!r} is not one of {allowed}")
    return name


class ConfigError(ValueError):
    """A configuration that cannot start a run; the message names every bad field."""
