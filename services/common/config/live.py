"""What a running run may change through the admin, derived from the change class each field carries
(``base.Change``: ``Live[...]``, ``Restart[...]``, ``Security[...]``...).

Fields are named by their dotted path in the config as dumped (aliases: ``train.kl.in``); a key may also name a
whole section (``alerts``) or reach into a mapping field (``reward.functions.exact_match``), which then has the
mapping's class.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from services.common.config.base import Change, ConfigError
from services.common.config.sections import RunConfig

# The one setting a live change could name code with: a 'module:function' reward plugin.
PLUGIN_FIELD = "reward.functions"
_UNSET = object()


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds (itself or optional), None for anything else (a list of rules is a value)."""
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for candidate in typing.get_args(annotation) if optional else (annotation,):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def change_class(info: FieldInfo) -> Change | None:
    """The class a field's annotation declares; None when it declares none (a unit test fails on that)."""
    return next((item for item in info.metadata if isinstance(item, Change)), None)


@functools.cache
def field_classes() -> dict[str, Change | None]:
    """Dotted path (by alias) -> the class of every field of the run config."""
    return {key: change_class(info) for key, _, info in _leaves()}


@functools.cache
def _leaves() -> tuple[tuple[str, str, FieldInfo], ...]:
    return tuple(_walk(RunConfig, "", ""))


def leaf_fields(model: type[BaseModel] = RunConfig) -> tuple[tuple[str, str, FieldInfo], ...]:
    """Every field of ``model`` (the run config) that holds a value, depth first: (dotted path by alias, dotted path
    by name, its FieldInfo). A section stands for its fields; a list or a mapping is one value."""
    return _leaves() if model is RunConfig else tuple(_walk(model, "", ""))


def _walk(model: type[BaseModel], key: str, named: str) -> Iterator[tuple[str, str, FieldInfo]]:
    for name, info in model.model_fields.items():
        child_key = f"{key}.{info.alias or name}" if key else info.alias or name
        child_named = f"{named}.{name}" if named else name
        inner = section_model(info.annotation)
        if inner is not None:
            yield from _walk(inner, child_key, child_named)
        else:
            yield child_key, child_named, info


def fields_of(*classes: Change) -> list[str]:
    """The fields of the given classes, in the config's order."""
    return [key for key, cls in field_classes().items() if cls in classes]


def _covers(key: str, leaf: str, named: str) -> bool:
    """``key`` names ``leaf``, a section holding it, or something inside it (a mapping's entry)."""
    return any(key == path or path.startswith(key + ".") or key.startswith(path + ".") for path in (leaf, named))


def classes_under(key: str) -> set[Change | None]:
    """The classes of the fields ``key`` changes: its own, its section's fields', or the mapping's it reaches into."""
    return {change_class(info) for leaf, named, info in _leaves() if _covers(key, leaf, named)}


def is_live(key: str) -> bool:
    """Whether a running service applies a stored change of ``key`` at once. A section is live when its fields
    are live or refused ones (which a stored change cannot have changed: ``refuse_unsafe_live_change``)."""
    classes = classes_under(key)
    return Change.LIVE in classes and not classes & {Change.RESTART, None}


def _refusal(field: str, cls: Change) -> ConfigError:
    reason = {
        Change.SECURITY: "is not changeable live (a security setting: where the run's data and credentials go, "
        "what it trusts or loads); set it in the config file or RLPIPE_* environment where the services are "
        "deployed, and restart them",
        Change.DEPLOY_TIME: "names the run and its broker or deployment (or who starts its replicas); set it where "
        "the services are deployed (config file or RLPIPE_* environment), not on a running run",
        Change.NEW_RUN: "is fixed for the run (new-run) and not changeable live: what the run has stored (its "
        "optimizer state, checkpoints, what weight sync sends) depends on it; start a new run with it",
    }[cls]
    return ConfigError(f"invalid configuration:\n  {field}: {reason}")


def _value_at(data: Any, path: str) -> Any:
    """What the by-alias dump ``data`` holds at ``path``; None where a section on the way is null or absent."""
    for part in path.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data


def _proposed(settings: Mapping[str, Any], leaf: str, named: str) -> Any:
    """What dotted ``settings`` (values that may be whole sections) set ``leaf`` to: a section set to null removes
    it. ``_UNSET`` when they do not reach it."""
    found = _UNSET
    for key, value in settings.items():
        for path in (leaf, named):
            if key == path:
                found = value
            elif path.startswith(key + "."):
                node = value
                for part in path.removeprefix(key + ".").split("."):
                    if node is None:
                        break  # the section above is removed, and the field with it
                    node = node.get(part, _UNSET) if isinstance(node, dict) else _UNSET
                if node is not _UNSET:
                    found = node
    return found


def refuse_unsafe_live_change(started: RunConfig, current: RunConfig, settings: Mapping[str, Any]) -> None:
    """Raise ConfigError, naming the field, if ``settings`` change a field the admin may not change (deploy-time,
    security, new-run) or name a new plugin.

    Checked on the raw settings before any validation, because validating a config imports the 'module:function'
    plugins it names: a live change must never make the trainer import code. Plugins the run started with
    (``started``, the file and environment config) were imported at start, so a change may still reweight them.
    A key naming a deploy-time field, or a section holding one, is refused even at the value in force: stored, it
    would outlive a redeployment. ``refuse_fixed_changes`` then checks the validated result.
    """
    for key in settings:
        if Change.DEPLOY_TIME in classes_under(key):
            raise _refusal(key, Change.DEPLOY_TIME)
    dump = current.model_dump(mode="json", by_alias=True)
    for leaf, named, info in _leaves():
        cls = change_class(info)
        if cls is None or not cls.refused_live:
            continue
        value = _proposed(settings, leaf, named)
        if value is not _UNSET and value != _value_at(dump, leaf):
            raise _refusal(leaf, cls)
        for key, value in settings.items():  # an entry of a mapping field: reward.http.headers_from_env.X-Key
            for path in (leaf, named):
                if key.startswith(path + ".") and value != _value_at(dump, leaf + key.removeprefix(path)):
                    raise _refusal(leaf, cls)
    functions = _proposed(settings, PLUGIN_FIELD, PLUGIN_FIELD)
    named = list(functions) if isinstance(functions, dict) else []
    named += [key.removeprefix(PLUGIN_FIELD + ".") for key in settings if key.startswith(PLUGIN_FIELD + ".")]
    if named:
        started_with = started.reward.functions
        new_plugins = sorted(str(name) for name in named if ":" in str(name) and name not in started_with)
        if new_plugins:
            raise ConfigError(
                f"invalid configuration:\n  {PLUGIN_FIELD}: {new_plugins[0]!r} is a 'module:function' plugin, "
                "imported only when a service starts: name it in the config file and restart; a live change may "
                "name registered functions and reweight the plugins the run started with"
            )


def refuse_fixed_changes(current: RunConfig, proposed: RunConfig) -> None:
    """Raise ConfigError naming the first field the admin may not change that differs between the config in force
    and the validated proposal: what the raw settings do not show (a section named with its defaults)."""
    before, after = current.model_dump(mode="json", by_alias=True), proposed.model_dump(mode="json", by_alias=True)
    for leaf, _, info in _leaves():
        cls = change_class(info)
        if cls is not None and cls.refused_live and _value_at(before, leaf) != _value_at(after, leaf):
            raise _refusal(leaf, cls)
