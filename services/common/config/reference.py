"""docs/configuration.md, generated from the models: ``python -m services.common.config.reference``.

`make config-reference` rewrites the file; a unit test fails while the checked-in copy differs from what this
prints, so the reference cannot drift from the models.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from services.common.config.alerts import AlertRule, default_alert_rules
from services.common.config.base import ENV_PREFIX
from services.common.config.live import change_class, section_model
from services.common.config.redaction import SECRET_FIELDS
from services.common.config.sections import AdminCredentials, RunConfig, S3Credentials

HEADER = f"""# Configuration reference

Generated from the models in `services/common/config/` by `python -m services.common.config.reference`
(`make config-reference`); edit the models' `description=`, not this file.

A run's config is one YAML file, validated when each service starts: a bad value stops it with the
field's dotted name and what is allowed. Environment variables `{ENV_PREFIX}<SECTION>__<FIELD>` win over
the file (`{ENV_PREFIX}TRAIN__LEARNING_RATE=5e-5`, nested sections with more `__`), and `rlpipe run` and
`rlpipe verify` take dotted `KEY=VALUE` overrides (`train.learning_rate=5e-5`, values read as YAML).
Every float is finite: `inf` and `nan` are refused.

The **change** column is the field's class: what `rlpipe config set` (the admin's UpdateConfig) does with it
on a running run. *live* fields apply between steps or batches; *restart* ones are stored and apply when the
services using them next start; the others are refused, naming the field: *security* settings decide where the
run's data, prompts, metrics and credentials go, what it trusts and what code it loads (every endpoint, host, URL,
path, file and token field is one), *deploy-time* ones which run, broker and deployment a service belongs to (set
both in the file or environment where the services are deployed, and restart them), and *new-run* ones what the
run has stored depends on (start a new run). A live change may not name a new `module:function` reward plugin:
plugins are imported only at start.
"""


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if arg is type(None) else _type_name(arg) for arg in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map {_type_name(args[0])} → {_type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"{annotation.__name__} (below)"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(info: FieldInfo) -> str:
    """``gt=0, le=1`` as ``> 0, ≤ 1``; pydantic keeps each constraint as a metadata object named by its attribute."""
    said = []
    for item in info.metadata:
        for attribute, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            if getattr(item, attribute, None) is not None:
                said.append(f"{sign} {getattr(item, attribute):g}")
        if getattr(item, "pattern", None):
            said.append(f"matches `{item.pattern}`")
        if getattr(item, "min_length", None):
            said.append("not empty" if item.min_length == 1 else f"at least {item.min_length} long")
    return ", ".join(said)


def _default(info: FieldInfo) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return "(the default rules)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, (list, dict)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").replace("<", "&lt;").split())


def _table(model: type[BaseModel], prefix: str, with_when: bool = True) -> Iterator[str]:
    yield (
        "| field | type | default | allowed | change | description |"
        if with_when
        else ("| field | type | default | allowed | description |")
    )
    yield "| --- | --- | --- | --- | --- | --- |" if with_when else "| --- | --- | --- | --- | --- |"
    for name, info in model.model_fields.items():
        if section_model(info.annotation) is not None:
            continue  # a section has its own heading and table
        key = f"{prefix}{info.alias or name}"
        secret = "; shown as `<redacted>`" if key in SECRET_FIELDS else ""
        when = f" {change_class(info) or 'unclassified'} |" if with_when else ""
        yield (
            f"| `{key}` | {_type_name(info.annotation)} | {_default(info)} | {_cell(_bounds(info))} |{when} "
            f"{_cell(info.description or '')}{secret} |"
        )


def _sections(model: type[BaseModel], prefix: str, level: int, about: str = "") -> Iterator[str]:
    """A heading and table for ``model``, then one for each section inside it, depth first."""
    yield f"{'#' * level} `{prefix.rstrip('.')}`" if prefix else f"{'#' * level} Top level"
    yield ""
    if about:
        yield f"{about[0].upper()}{about[1:]}."
        yield ""
    yield from _table(model, prefix)
    yield ""
    for name, info in model.model_fields.items():
        inner = section_model(info.annotation)
        if inner is not None:
            optional = " Optional: null (the default) leaves it out." if info.default is None else ""
            child_level = min(level + 1, 4) if prefix else level
            yield from _sections(
                inner, f"{prefix}{name}.", child_level, f"{info.description or ''}.{optional}".strip(".")
            )


def render() -> str:
    lines = [HEADER]
    lines += list(_sections(RunConfig, "", 2))
    lines += ["## `alerts.rules[]`: one alert rule", "", " ".join((AlertRule.__doc__ or "").split()), ""]
    lines += list(_table(AlertRule, "alerts.rules[].", with_when=False))
    lines += [
        "",
        "### The default rules",
        "",
        "| name | metric | condition | threshold | window | severity | actions |",
    ]
    lines += ["| --- | --- | --- | --- | --- | --- | --- |"]
    for rule in default_alert_rules():
        steps = "step" if rule.window_steps == 1 else "steps"
        window = f"{rule.window_s:g} s" if rule.condition == "absent" else f"{rule.window_steps} {steps}"
        lines.append(
            f"| `{rule.name}` | `{rule.metric}` | {rule.condition} | {rule.threshold:g} | {window} | {rule.severity} "
            f"| {', '.join(rule.actions)} |"
        )
    lines += ["", "## Credentials", ""]
    lines += [
        "Never read from the YAML, never logged: only from the environment or a secrets file of the same name in "
        "`/run/secrets` (Docker and Kubernetes secrets).",
        "",
    ]
    for model, prefix in ((S3Credentials, "RLPIPE_S3_"), (AdminCredentials, "RLPIPE_ADMIN_")):
        lines += ["| variable | description |", "| --- | --- |"]
        lines += [
            f"| `{prefix}{name.upper()}` | {_cell(info.description or '')} |"
            for name, info in model.model_fields.items()
        ]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
