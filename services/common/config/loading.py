"""Loading a run's config: YAML, then ``RLPIPE_*`` environment overrides, then dotted ``KEY=VALUE`` overrides."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from services.common.config.base import ConfigError, read_environment
from services.common.config.redaction import SECRET_FIELDS, hide_url_secrets
from services.common.config.sections import DeploymentEnvironment, RunConfig


def _describe(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "<root>"
        message = hide_url_secrets(item["msg"].removeprefix("Value error, "))
        given = item.get("input")
        secret = field in SECRET_FIELDS  # a webhook URL's path often holds a token
        shown = "" if isinstance(given, (dict, list)) or given is None or secret else f" (got {given!r})"
        lines.append(f"  {field}: {message}{hide_url_secrets(shown)}")
    return lines


def load_config(path: Path | str | None = None, **overrides: Any) -> RunConfig:
    """Read the YAML at ``path`` (if any), apply ``overrides`` and the ``RLPIPE_*`` environment."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        data = _read_yaml(path)
    data.update(overrides)
    problems: list[str] = []
    cfg = None
    try:
        cfg = RunConfig(**data)
    except ValidationError as error:
        problems = _describe(error)
    # Checked even when fields failed, so that one run of the command names every problem.
    environment = cfg.environment if cfg is not None else data.get("environment")
    deployment = DeploymentEnvironment().env
    if deployment and isinstance(environment, str) and deployment != environment:
        problems.append(
            f"  environment: this config is for {environment!r} "
            f"but RLPIPE_ENV is {deployment!r}; use the config of this environment or set RLPIPE_ENV to match"
        )
    if problems or cfg is None:
        raise ConfigError("invalid configuration:\n" + "\n".join(problems))
    return cfg


def _yaml_position(error: yaml.MarkedYAMLError) -> str:
    """Where the parser stopped and what it expected, and where the construct it was reading began."""

    def at(mark: yaml.Mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    mark = error.problem_mark or error.context_mark
    said = f"at {at(mark)}: " if mark is not None else ": "
    said += error.problem or error.context or "unreadable"
    if error.problem_mark is not None and error.context_mark is not None and error.context:
        said += f" ({error.context} that starts at {at(error.context_mark)})"
    return said


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.MarkedYAMLError as error:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML {_yaml_position(error)}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def parse_value(text: str) -> Any:
    """A setting's value as the operator typed it, read as YAML: ``5e-5``, ``[notify, pause]``, ``{exact_match: 1}``."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"value {text!r} is not valid YAML: {error}") from None


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``KEY=VALUE`` settings as typed on a command line (``train.learning_rate=5e-5``) as dotted overrides.

    Each value is read as YAML, as `rlpipe config set` reads it. ConfigError, in one line, names the first
    item that is not ``KEY=VALUE`` or whose value is not YAML.
    """
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not KEY=VALUE (a dotted key, e.g. train.learning_rate=5e-5)")
        try:
            overrides[key.strip()] = parse_value(text)
        except ConfigError as error:
            raise ConfigError(f"override {key.strip()}: {' '.join(str(error).split())}") from None
    return overrides


def load_config_with(path: Path | str, overrides: Mapping[str, Any]) -> tuple[RunConfig, dict[str, Any]]:
    """The run config of the file at ``path`` with dotted ``overrides`` written into it, and that file's data.

    The data is for processes that read a config file (``rlpipe run``'s services): written out as YAML, it
    loads to the same config. ``RLPIPE_*`` variables still apply on top, as they do over the file, so an
    override that one of them would undo is refused rather than silently lost. Errors are one-line
    ConfigErrors naming the override (an unknown key, a value its field refuses).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    data = _read_yaml(path)
    for key, value in overrides.items():
        try:
            _set_dotted(data, RunConfig, key, value)
        except ConfigError as error:
            raise ConfigError(f"override {_one_line(error)}") from None
    try:
        cfg = load_config(None, **data)
    except ConfigError as error:
        if not overrides:
            raise  # the file's own problems, one line each as load_config names them
        raise ConfigError(f"invalid override: {_one_line(error)}") from None
    token = read_environment.set(False)
    try:
        as_written = RunConfig(**data)
    finally:
        read_environment.reset(token)
    for key in overrides:
        if dotted_value(cfg, key) != dotted_value(as_written, key):
            raise ConfigError(
                f"override {key}: an RLPIPE_* environment variable sets it too and would win; unset it or drop "
                "the override"
            )
    return cfg, data


def _one_line(error: ConfigError) -> str:
    """A ConfigError's field lines joined into one, without the ``invalid configuration:`` heading."""
    lines = str(error).removeprefix("invalid configuration:").strip().splitlines()
    return "; ".join(line.strip() for line in lines)


def dotted_value(cfg: RunConfig, key: str) -> Any:
    node: Any = cfg.model_dump(mode="json")
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _set_dotted(data: dict[str, Any], model: type[BaseModel] | None, key: str, value: Any) -> None:
    """Set ``key`` (dotted, field names or aliases) in a by-alias dump of ``model``; unknown fields are refused."""
    parts = key.split(".")
    node: Any = data
    for depth, part in enumerate(parts):
        if model is not None:
            # A field is known by its name or its alias; the dump uses the alias.
            keys = {name: info.alias or name for name, info in model.model_fields.items()}
            keys |= {alias: alias for alias in keys.values()}
            if part not in keys:
                raise ConfigError(
                    f"invalid configuration:\n  {key}: no such field (allowed here: {sorted(model.model_fields)})"
                )
            field = next(info for name, info in model.model_fields.items() if (info.alias or name) == keys[part])
            part = keys[part]
            annotation = field.annotation
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        elif not isinstance(node, dict):
            raise ConfigError(f"invalid configuration:\n  {key}: {'.'.join(parts[:depth])} holds no fields")
        if depth == len(parts) - 1:
            node[part] = value
        else:
            node = node.setdefault(part, {})


def apply_overrides(base: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """``base`` with dotted ``overrides`` (``{"train.learning_rate": 5e-5}``), validated.

    The environment is not read again: an operator's change must not be undone by it.
    """
    data = base.model_dump(mode="json", by_alias=True)
    for key, value in overrides.items():
        _set_dotted(data, RunConfig, key, value)
    token = read_environment.set(False)
    try:
        return RunConfig(**data)
    except ValidationError as error:
        raise ConfigError("invalid configuration:\n" + "\n".join(_describe(error))) from None
    finally:
        read_environment.reset(token)
