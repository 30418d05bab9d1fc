"""Every config field carries its change class; the admin's refusals and the live set are derived from them."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from services.common.config import (
    Change,
    ConfigError,
    RunConfig,
    Section,
    apply_overrides,
    change_class,
    fields_of,
    is_live,
    leaf_fields,
    refuse_fixed_changes,
    refuse_unsafe_live_change,
)
from services.common.config.base import Live, Restart
from tests.support.runs import run_config

pytestmark = pytest.mark.unit

# A field whose name says it names where something is or goes, or a credential: an endpoint, host, URL, path, file
# or token (a count of tokens, max_new_tokens, is none of them).
WHERE = re.compile(r"(^|_)(url|uri|host|endpoint|file|dir|path|pool|cert|key|ca|token)$|endpoint|^token_")


def holds_a_path(annotation: typing.Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return True
    return any(holds_a_path(arg) for arg in typing.get_args(annotation))


def unclassified(model: type[BaseModel]) -> list[str]:
    return [key for key, _, info in leaf_fields(model) if change_class(info) is None]


def names_where_data_goes(model: type[BaseModel]) -> list[str]:
    """The fields that name an endpoint, host, URL, path, file or token (by name or by a Path type) and are not
    security settings."""
    return [
        key
        for key, named, info in leaf_fields(model)
        if (holds_a_path(info.annotation) or WHERE.search(named.rpartition(".")[2]))
        and not ((cls := change_class(info)) is not None and cls.security)
    ]


def test_every_field_of_the_run_config_declares_its_change_class():
    assert unclassified(RunConfig) == []


def test_every_endpoint_host_url_path_file_or_token_field_is_a_security_setting():
    assert names_where_data_goes(RunConfig) == []
    # What the security review found an admin token could redirect, among them.
    for field in (
        "rollout.environment_url",
        "service.trainer_host",
        "rollout.relay_host",
        "metrics_path",
        "runs_dir",
        "service.log_dir",
        "reward.http.token_file",
    ):
        assert field in fields_of(Change.SECURITY), field


class Planted(Section):
    """A section as a helper might add one: a field without a class, and a callback URL classed as restart."""

    unmarked: int = Field(1, description="a new knob")
    callback_url: Restart[str] = Field("", description="where results are POSTed")
    spool_dir: Restart[Path | None] = Field(None, description="where results are kept")
    rate: Live[float] = Field(1.0, description="a live knob")


class PlantedRun(BaseModel):
    planted: Planted = Field(Planted(), description="the planted section")
    optional: Planted | None = Field(None, description="the same, optional")


def test_the_walks_catch_a_field_without_a_class_and_a_url_or_path_that_is_not_a_security_setting():
    assert unclassified(PlantedRun) == ["planted.unmarked", "optional.unmarked"]
    assert names_where_data_goes(PlantedRun) == [
        "planted.callback_url",
        "planted.spool_dir",
        "optional.callback_url",
        "optional.spool_dir",
    ]


def test_a_section_is_live_only_when_every_field_in_it_is_live_or_refused():
    assert is_live("train.learning_rate") and is_live("train.clip") and is_live("train.kl.coef")
    assert not is_live("train") and not is_live("train.kl") and not is_live("train.batch_size")
    assert is_live("alerts") and not is_live("alerts.webhook_url")  # a stored 'alerts' kept the webhook in force
    assert is_live("reward.functions") and is_live("reward.functions.exact_match")  # an entry of a live mapping
    assert not is_live("reward.http.token_file") and not is_live("reward.http")
    assert not is_live("no_such.field")


@pytest.fixture
def base(tmp_path: Path, config_only_model) -> RunConfig:
    (tmp_path / "token").write_text("s3cret-token\n")
    http = {"url": "http://127.0.0.1:1/score", "token_file": str(tmp_path / "token")}
    return run_config(tmp_path, config_only_model, reward={"http": http})


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"rollout.environment_url": "http://elsewhere/env"}, "rollout.environment_url"),
        ({"service.trainer_host": "elsewhere"}, "service.trainer_host"),
        ({"rollout.relay_host": "elsewhere"}, "rollout.relay_host"),
        ({"metrics_path": "/tmp/elsewhere.jsonl"}, "metrics_path"),
        ({"runs_dir": "/tmp/elsewhere"}, "runs_dir"),
        ({"service.log_dir": "/tmp/elsewhere"}, "service.log_dir"),
        ({"reward.http.token_file": "/proc/self/environ"}, "reward.http.token_file"),
        ({"service": {"trainer_host": "elsewhere", "torch_threads": 2}}, "service.trainer_host"),
        # Into a mapping field: would send an environment variable of the reward role's choosing as a header.
        ({"reward.http.headers_from_env.X-Key": "RLPIPE_S3_SECRET_KEY"}, "reward.http.headers_from_env"),
        # A section removed takes its security fields with it.
        ({"reward.http": None}, "reward.http.url"),
        ({"rollout.environment": "my_module:Env"}, "rollout.environment"),  # names code: refused before importing it
    ],
)
def test_the_admin_refuses_a_security_setting_naming_the_field(base, settings, field):
    with pytest.raises(ConfigError, match=rf"  {re.escape(field)}: is not changeable live \(a security setting"):
        refuse_unsafe_live_change(base, base, settings)


def test_a_section_given_with_its_defaults_is_refused_once_validated(base):
    # The raw settings do not name model.lora.r; the validated config has it.
    settings = {"model.lora": {}}
    refuse_unsafe_live_change(base, base, settings)
    with pytest.raises(ConfigError, match=r"model\.lora\.r: is fixed for the run \(new-run\)"):
        refuse_fixed_changes(base, apply_overrides(base, settings))
    refuse_fixed_changes(base, apply_overrides(base, {"train.learning_rate": 1e-5, "train.batch_size": 4}))


def test_a_deploy_time_field_or_a_section_holding_one_is_refused_even_at_its_value(base):
    for key, value in (("run_id", base.run_id), ("nats", {"ack_wait_s": 10}), ("environment", "prod")):
        with pytest.raises(ConfigError, match=rf"  {key}: names the run and its broker or deployment"):
            refuse_unsafe_live_change(base, base, {key: value})


def test_every_class_is_used_and_the_refused_ones_are_the_admins_refusals():
    used = {change_class(info) for _, _, info in leaf_fields()}
    assert used == set(Change)
    assert {cls for cls in Change if cls.refused_live} == {Change.SECURITY, Change.DEPLOY_TIME, Change.NEW_RUN}
    assert {cls for cls in Change if cls.security} == {Change.SECURITY, Change.DEPLOY_TIME}


def test_a_field_class_is_metadata_pydantic_and_the_reference_see_through():
    info = RunConfig.model_fields["runs_dir"]
    assert info.annotation is Path and change_class(info) is Change.SECURITY
    assert typing.get_origin(Live[float]) is typing.Annotated and not isinstance(Live[float], types.UnionType)
