"""Reading a tune file (``services/tuner/spec.py`` holds its fields): every key checked against the run config it
tunes before any trial runs, and each trial's run config built from it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from services.common.config import ConfigError, RunConfig, apply_overrides, hide_url_secrets, load_config
from services.common.observe.metrics import find
from services.common.observe.usage import PRICED_QUANTITIES, RUN_QUANTITIES
from services.tuner.spec import (
    USAGE_PREFIX,
    CategoricalParam,
    FloatParam,
    IntParam,
    MetricConstraint,
    Scalar,
    TuneFileError,
    TuneSpec,
)

if TYPE_CHECKING:
    from typing_extensions import TypeForm


def _field_of(key: str) -> TypeForm[Any] | None:
    """The annotation of the dotted run-config field ``key``; raises naming the first part that is not one."""
    model: type[BaseModel] = RunConfig
    parts = key.split(".")
    for depth, part in enumerate(parts):
        fields = {info.alias or name: info for name, info in model.model_fields.items()}
        fields |= dict(model.model_fields)
        if part not in fields:
            raise ValueError(
                f"no such field {part!r} in {'.'.join(parts[:depth]) or 'the run config'} "
                f"(allowed: {sorted(model.model_fields)})"
            )
        annotation = fields[part].annotation
        section = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if depth == len(parts) - 1:
            if section is not None:
                raise ValueError(f"{key} is a section; name one of its fields ({sorted(section.model_fields)})")
            return annotation
        if section is None:
            raise ValueError(f"{'.'.join(parts[: depth + 1])} holds no fields")
        model = section
    return None


def get_dotted(data: dict[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        node = node[part]
    return node


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` in a raw config mapping, creating sections the file left to their defaults."""
    *sections, leaf = key.split(".")
    node = data
    for part in sections:
        node = node.setdefault(part, {})
    node[leaf] = value


def _check_space(spec: TuneSpec, base: RunConfig) -> list[str]:
    """Problems of the search space against the run config, each naming its key."""
    problems: list[str] = []
    dumped = base.model_dump(mode="json", by_alias=True)
    seen: list[str] = []
    for key, param in spec.space.items():
        try:
            annotation = _field_of(key)
        except ValueError as error:
            problems.append(f"space.{key}: {error}")
            seen.append(key)
            continue
        if key in ("run_id", "runs_dir", "metrics_path") or key.startswith(("nats.url", "checkpoint.store_url")):
            problems.append(f"space.{key}: the tuner sets this per trial (isolation); it cannot be searched")
        if isinstance(param, IntParam) and annotation is float:
            pass  # an int range over a float field is fine: ints are floats
        elif isinstance(param, FloatParam) and annotation is int:
            problems.append(f"space.{key}: the field is an integer; use type: int")
        # Both ends (or every choice) must be a value the run config accepts, or trials fail for nothing.
        values = param.choices if isinstance(param, CategoricalParam) else [param.low, param.high]
        for value in values:
            try:
                apply_overrides(base, {key: value})
            except ConfigError as error:
                detail = str(error).removeprefix("invalid configuration:\n").strip()
                problems.append(f"space.{key}: {value!r} is refused by the run config: {detail}")
        if param.when is not None:
            other = param.when.param
            if other in spec.space:
                if other not in seen:
                    problems.append(f"space.{key}.when: {other} must be listed before {key} (it is sampled first)")
            else:
                try:
                    _field_of(other)
                    get_dotted(dumped, other)
                except (ValueError, KeyError) as error:
                    problems.append(f"space.{key}.when.param: {other}: {error}")
        seen.append(key)
    for key, value in spec.fixed.items():
        try:
            _field_of(key)
            apply_overrides(base, {key: value})
        except (ValueError, ConfigError) as error:
            detail = str(error).removeprefix("invalid configuration:\n").strip()
            problems.append(f"fixed.{key}: {detail}")
        if key in spec.space:
            problems.append(f"fixed.{key}: also in the space; a key is either fixed or searched")
    for i, params in enumerate(spec.enqueue):
        for key in params:
            if key not in spec.space:
                problems.append(f"enqueue[{i}].{key}: not a parameter of the space")
    return problems


def _check_metrics(spec: TuneSpec, base: RunConfig) -> list[str]:
    """Problems of the objective's and constraints' metrics, each naming its key: a row key the metrics contract
    does not declare (services/common/observe/metrics.py), a ``usage.`` quantity that does not exist or needs
    prices."""
    named = [("objective.metric", spec.objective.metric)]
    named += [
        (f"objective.constraints[{i}].metric", c.metric)
        for i, c in enumerate(spec.objective.constraints)
        if isinstance(c, MetricConstraint)
    ]
    problems = []
    for key, metric in named:
        if not metric.startswith(USAGE_PREFIX):
            if find(metric) is None:
                problems.append(f"{key}: {metric} is not a metric the trainer writes (docs/metrics.md lists them)")
            continue
        quantity = metric.removeprefix(USAGE_PREFIX)
        if quantity not in RUN_QUANTITIES:
            problems.append(f"{key}: {metric} is not a usage quantity (allowed: {', '.join(RUN_QUANTITIES)})")
        elif quantity in PRICED_QUANTITIES and not base.cost.per_device_hour:
            problems.append(f"{key}: {metric} needs prices: set cost.per_device_hour in the base config")
    objective = spec.objective.metric
    if objective.startswith(USAGE_PREFIX) and spec.pruner.kind != "none":
        problems.append(
            f"pruner.kind: {spec.pruner.kind} cannot prune on {objective}, which is known only when a trial has "
            "ended; set pruner.kind: none"
        )
    return problems


def _describe(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors():
        # A discriminated union puts the tag in the path ("space.x.float.low"); the reader wrote "space.x.low".
        parts = [str(p) for p in item["loc"] if p not in ("float", "int", "categorical")]
        given = item.get("input")
        shown = "" if isinstance(given, (dict, list)) or given is None else f" (got {given!r})"
        # A storage URL's password (postgresql://user:PASSWORD@host) stays out of the message.
        message = hide_url_secrets(f"{item['msg'].removeprefix('Value error, ')}{shown}")
        lines.append(f"{'.'.join(parts) or '<root>'}: {message}")
    return lines


def load_tune_file(path: Path | str, storage: str | None = None) -> tuple[TuneSpec, RunConfig]:
    """The validated tune file (``storage`` in place of its own) and its base run config.

    Raises TuneFileError naming every bad key.
    """
    path = Path(path)
    if not path.is_file():
        raise TuneFileError(f"tune file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise TuneFileError(f"tune file {str(path)!r} is not YAML: {error}") from None
    if not isinstance(data, dict):
        raise TuneFileError(f"tune file {str(path)!r} must hold a mapping at the top level")
    if storage:
        data["storage"] = storage
    try:
        spec = TuneSpec(**data)
    except ValidationError as error:
        raise TuneFileError(f"invalid tune file {path}:\n  " + "\n  ".join(_describe(error))) from None
    try:
        base = load_config(spec.base_config)
    except ConfigError as error:
        raise TuneFileError(f"invalid tune file {path}:\n  base_config: {error}") from None
    problems = _check_space(spec, base) + _check_metrics(spec, base)
    if problems:
        raise TuneFileError(f"invalid tune file {path}:\n  " + "\n  ".join(problems))
    return spec, base


def base_config_data(spec: TuneSpec) -> dict[str, Any]:
    """The base config file as written (not the model dump): trial configs keep its shape, comments aside."""
    return yaml.safe_load(spec.base_config.read_text()) or {}


def trial_config_data(
    spec: TuneSpec, base: RunConfig, params: dict[str, Scalar], run_id: str, runs_dir: Path
) -> dict[str, Any]:
    """A trial's run config: the base file, the sampled params, and what isolates the trial from the others.

    Its own run id gives it its own streams (``RLPIPE_<run>_*``), config bucket and checkpoint prefix; its
    own runs dir its own embedded NATS store. The admin port is 0 so trials side by side never collide.
    """
    data = base_config_data(spec)
    for key, value in {**spec.fixed, **params}.items():
        set_dotted(data, key, value)
    data["run_id"] = run_id
    data["runs_dir"] = str(runs_dir)
    data.pop("metrics_path", None)  # else every trial would append to one file
    if spec.trial.max_steps is not None:
        total = params.get("train.total_steps", spec.fixed.get("train.total_steps", base.train.total_steps))
        set_dotted(data, "train.total_steps", min(int(total), spec.trial.max_steps))
    set_dotted(data, "admin.port", 0)
    # A trial's roles stay in its own process group, the unit the tuner measures and kills: none is forked from a
    # warm-start pool, whose processes live in the pool's group.
    set_dotted(data, "service.warm_start_pool", None)
    return data
