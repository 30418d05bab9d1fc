import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common import registry
from services.common.config import (
    AdminCredentials,
    BuildInfo,
    Change,
    ConfigError,
    DeploymentEnvironment,
    RunConfig,
    S3Credentials,
    Section,
    apply_overrides,
    fields_of,
    load_config,
    parse_overrides,
    reference,
    refuse_unsafe_live_change,
)
from tests.support.paths import ROOT
from tests.support.runs import write_config

pytestmark = pytest.mark.unit


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("train", "eval"):
        (folder / f"{split}.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return folder


def test_yaml_values_and_env_overrides(tmp_path, model_dir, data_dir, monkeypatch):
    path = write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", train={"learning_rate": 0.01})
    assert load_config(path).train.learning_rate == 0.01
    monkeypatch.setenv("RLPIPE_TRAIN__LEARNING_RATE", "0.5")
    monkeypatch.setenv("RLPIPE_SAMPLING__TEMPERATURE", "0.7")
    cfg = load_config(path)
    assert cfg.train.learning_rate == 0.5
    assert cfg.sampling.temperature == 0.7
    assert cfg.train.batch_size == 8  # the rest of the section still comes from YAML


def test_seed_example_fields_are_expressible(tmp_path, model_dir, data_dir):
    # The seed's names: task_name, seed, batch_size, learning_rate, grad_accum_steps, max_seq_len,
    # save_every_steps, entropy_coef, kl_coef (kl.coef), clip_range (clip.low/high), log_interval, metrics path.
    train = {
        "seed": 7,
        "batch_size": 4,
        "learning_rate": 2e-5,
        "grad_accum_steps": 2,
        "max_seq_len": 48,
        "entropy_coef": 0.01,
        "log_interval": 5,
    }
    path = write_config(
        tmp_path / "c.yaml",
        model_dir,
        data_dir,
        tmp_path / "runs",
        train={**train, "kl": {"coef": 0.05, "in": "reward"}, "clip": {"low": 0.3, "high": 0.3}},
        checkpoint={"save_every_steps": 10},
        data={"task_name": "arithmetic"},
        metrics_path=str(tmp_path / "m.jsonl"),
    )
    cfg = load_config(path)
    assert cfg.train.model_dump(include=set(train)) == train
    assert cfg.train.kl.coef == 0.05 and cfg.train.kl.placement == "reward" and cfg.train.clip.high == 0.3
    assert cfg.checkpoint.save_every_steps == 10 and cfg.data.task_name == "arithmetic"
    assert cfg.metrics_file == tmp_path / "m.jsonl"


def test_nested_env_override_of_algorithm_settings(tmp_path, model_dir, data_dir, monkeypatch):
    path = write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs")
    monkeypatch.setenv("RLPIPE_TRAIN__ALGORITHM", "ppo")
    monkeypatch.setenv("RLPIPE_TRAIN__KL__COEF", "0.2")
    monkeypatch.setenv("RLPIPE_TRAIN__CLIP__HIGH", "0.28")
    cfg = load_config(path)
    assert (cfg.train.algorithm, cfg.train.kl.coef, cfg.train.clip.high) == ("ppo", 0.2, 0.28)


@pytest.mark.parametrize(
    ("change", "field", "allowed"),
    [
        ({"train": {"algorithm": "sarsa"}}, "train.algorithm", "'reinforce_pp'"),
        ({"train": {"loss_agg": "median"}}, "train.loss_agg", "seq-mean-token-sum-norm"),
        ({"train": {"kl": {"estimator": "k9"}}}, "train.kl.estimator", "'k3'"),
        ({"train": {"clip": {"dual": 0.5}}}, "train.clip.dual", "greater than 1"),
        ({"train": {"learning_rate": -0.1}}, "train.learning_rate", "greater than 0"),
        ({"model": {"path": "/nowhere/model"}}, "model.path", "/nowhere/model"),
        ({"reward": {"functions": {"vibes": 1.0}}}, "reward", "exact_match"),
        ({"rollout": {"backend": "tgi"}}, "rollout.backend", "'vllm' or 'hf'"),
        ({"rollout": {"hf": {"static_batch_buckets": [8, 4]}}}, "rollout.hf.static_batch_buckets", "ascending"),
    ],
)
def test_bad_config_names_the_field(tmp_path, model_dir, data_dir, change, field, allowed):
    path = write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", **change)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert field in str(error.value) and allowed in str(error.value)


def test_a_name_registered_before_loading_is_accepted_like_a_built_in(tmp_path, model_dir, data_dir):
    path = write_config(
        tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", train={"kl": {"estimator": "k_user"}}
    )
    with pytest.raises(ConfigError, match=r"train\.kl\.estimator"):
        load_config(path)
    registry.KL_ESTIMATORS.register("k_user")(lambda logp, ref_logp: logp - ref_logp)
    try:
        assert load_config(path).train.kl.estimator == "k_user"
    finally:
        del registry.KL_ESTIMATORS["k_user"]


def test_duplicate_window_must_outlive_redelivery(tmp_path, model_dir, data_dir):
    path = write_config(
        tmp_path / "c.yaml",
        model_dir,
        data_dir,
        tmp_path / "runs",
        nats={"ack_wait_s": 60, "max_deliver": 5, "duplicate_window_s": 120},
    )
    with pytest.raises(ConfigError, match="duplicate_window_s must be longer"):
        load_config(path)


def test_heartbeat_must_come_before_the_ack_wait_ends(tmp_path, model_dir, data_dir):
    path = write_config(
        tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", nats={"ack_wait_s": 10, "heartbeat_s": 10}
    )
    with pytest.raises(ConfigError, match=r"nats: .*heartbeat_s \(10.0\) must be below ack_wait_s"):
        load_config(path)


def test_a_multi_turn_run_that_may_wait_on_its_environment_past_max_work_s_is_refused(tmp_path, model_dir, data_dir):
    rollout = {"environment_url": "http://envs:8090", "environment_timeout_s": 30, "environment_retries": 2}
    path = write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", rollout=rollout)
    with pytest.raises(ConfigError, match=r"= 5 x 3 x 30 = 450s, not below nats.max_work_s \(300s\)"):
        load_config(path, nats={"max_work_s": 300})
    assert load_config(path, nats={"max_work_s": 451}).rollout.max_turns == 4
    # A plugin in the rollout's process is tried once per call.
    local = write_config(
        tmp_path / "l.yaml",
        model_dir,
        data_dir,
        tmp_path / "runs",
        rollout={"environment": "calculator", "environment_timeout_s": 30},
    )
    assert load_config(local, nats={"max_work_s": 151}).rollout.multi_turn
    with pytest.raises(ConfigError, match=r"= 5 x 1 x 30 = 150s"):
        load_config(local, nats={"max_work_s": 150})


@pytest.mark.integration
@pytest.mark.parametrize("role", ["trainer", "rollout", "reward", "reference"])
def test_service_refuses_bad_config_at_startup(tmp_path, model_dir, data_dir, role):
    path = write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", train={"learning_rate": -1})
    done = subprocess.run(
        [sys.executable, "-m", f"services.{role}", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "train.learning_rate" in done.stderr


@pytest.mark.integration
def test_rlpipe_run_refuses_missing_model_path(tmp_path, model_dir, data_dir):
    path = write_config(
        tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", model={"path": str(tmp_path / "absent")}
    )
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "model.path" in done.stderr and str(tmp_path / "absent") in done.stderr


def every_section(base: type[Section] = Section) -> list[type[Section]]:
    return [cls for sub in base.__subclasses__() for cls in (sub, *every_section(sub))]


FLOAT_FIELDS = sorted(
    (cls.__name__, name)
    for cls in set(every_section())
    for name, info in cls.model_fields.items()
    # A float, or an optional one; the weights of reward.functions are checked through a config file below.
    if info.annotation is float
    or (typing.get_origin(info.annotation) is not dict and float in typing.get_args(info.annotation))
)


def test_the_finite_check_walks_nested_and_optional_sections_and_optional_floats():
    assert {
        ("TrainConfig", "learning_rate"),
        ("ClipConfig", "dual"),  # float | None
        ("AlertRule", "threshold"),  # a list item of a section
        ("RewardHttpConfig", "weight"),  # an optional section
    } <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize(("section", "name"), FLOAT_FIELDS)
def test_every_float_setting_of_every_section_refuses_infinity_and_nan(section, name, value):
    cls = next(cls for cls in every_section() if cls.__name__ == section)
    with pytest.raises(ValidationError) as error:
        cls(**{name: value})
    assert {item["type"] for item in error.value.errors() if item["loc"] == (name,)} == {"finite_number"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"train": {"learning_rate": math.inf}}, "train.learning_rate"),
        ({"train": {"learning_rate": "inf"}}, "train.learning_rate"),
        ({"reward": {"functions": {"exact_match": math.nan}}}, "reward.functions.exact_match"),
        ({"sampling": {"temperature": math.inf}}, "sampling.temperature"),
    ],
)
def test_a_config_file_with_an_infinite_or_nan_setting_is_refused_naming_the_field(
    tmp_path, model_dir, data_dir, change, field
):
    path = write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", **change)
    with pytest.raises(ConfigError, match=rf"{field}: Input should be a finite number"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.learning_rate=inf", "train.learning_rate"),
        ("train.learning_rate=.inf", "train.learning_rate"),
        ("train.kl.coef=.nan", "train.kl.coef"),
        ("reward.functions={exact_match: .nan}", "reward.functions.exact_match"),
    ],
)
def test_a_live_change_to_infinity_or_nan_is_refused_naming_the_field(tmp_path, model_dir, data_dir, override, field):
    # apply_overrides is how `rlpipe config set` validates a change on the trainer before storing it.
    base = load_config(write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs"))
    with pytest.raises(ConfigError, match=rf"{field}: Input should be a finite number"):
        apply_overrides(base, parse_overrides([override]))


@pytest.fixture
def plugin_module(tmp_path, monkeypatch) -> str:
    """An importable reward plugin that records being imported: the name of its module."""
    (tmp_path / "live_plugin_probe.py").write_text(
        "IMPORTED = True\ndef score(prompt, completion, answer):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "live_plugin_probe"
    sys.modules.pop("live_plugin_probe", None)


def parse_nested(dotted: str, value: object) -> dict:
    """``{"a": {"b": value}}`` for ``"a.b"``: how a whole section is set at once."""
    head, _, rest = dotted.partition(".")
    return {head: parse_nested(rest, value) if rest else value}


@pytest.mark.parametrize("field", fields_of(Change.SECURITY))
def test_a_live_change_of_a_security_setting_is_refused_naming_the_field(tmp_path, model_dir, data_dir, field):
    base = load_config(write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs"))
    section, _, rest = field.partition(".")
    for settings in ({field: "elsewhere"}, {section: parse_nested(rest, "elsewhere")} if rest else {}):
        if settings:
            with pytest.raises(ConfigError, match=rf"{field}: is not changeable live \(a security setting"):
                refuse_unsafe_live_change(base, base, settings)


def test_a_live_change_may_repeat_a_security_setting_at_the_value_in_force(tmp_path, model_dir, data_dir):
    base = load_config(
        write_config(
            tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", checkpoint={"store_url": "file:///srv/ckpt"}
        )
    )
    # A whole section sent back with one live field changed carries the store URL unchanged.
    refuse_unsafe_live_change(base, base, {"checkpoint": {"store_url": "file:///srv/ckpt", "keep_last": 5}})
    refuse_unsafe_live_change(base, base, {"checkpoint.save_every_steps": 5})


def test_a_live_change_naming_a_new_plugin_is_refused_before_the_plugin_is_imported(
    tmp_path, model_dir, data_dir, plugin_module
):
    base = load_config(write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs"))
    settings = parse_overrides([f"reward.functions={{exact_match: 1.0, {plugin_module}:score: 0.5}}"])
    with pytest.raises(ConfigError, match=rf"reward.functions: '{plugin_module}:score' is a 'module:function' plugin"):
        refuse_unsafe_live_change(base, base, settings)
    with pytest.raises(ConfigError, match="'module:function' plugin"):
        refuse_unsafe_live_change(base, base, {"reward": {"functions": {f"{plugin_module}:score": 1.0}}})
    with pytest.raises(ConfigError, match="'module:function' plugin"):  # an entry of the mapping, by its key
        refuse_unsafe_live_change(base, base, {f"reward.functions.{plugin_module}:score": 1.0})
    assert plugin_module not in sys.modules


def test_a_live_change_may_reweight_a_plugin_the_run_started_with(tmp_path, model_dir, data_dir, plugin_module):
    plugin = f"{plugin_module}:score"
    path = write_config(
        tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", reward={"functions": {plugin: 1.0}}
    )
    base = load_config(path)  # imported here, at start
    settings = {"reward.functions": {plugin: 0.5, "exact_match": 1.0}}
    refuse_unsafe_live_change(base, base, settings)
    assert apply_overrides(base, settings).reward.functions == {plugin: 0.5, "exact_match": 1.0}


def test_every_config_field_is_described():
    models = {*every_section(), RunConfig, S3Credentials, AdminCredentials, BuildInfo, DeploymentEnvironment}
    fields = [(model.__name__, name, info) for model in models for name, info in model.model_fields.items()]
    undescribed = sorted(f"{model}.{name}" for model, name, info in fields if not info.description)
    assert undescribed == []


def test_the_checked_in_configuration_reference_is_what_the_models_generate():
    checked_in = (ROOT / "docs" / "configuration.md").read_text()
    assert checked_in == reference.render(), "docs/configuration.md is stale: run `make config-reference`"


def test_the_configuration_reference_marks_live_restart_and_refused_fields():
    rows = {line.split("|")[1].strip(" `"): line for line in reference.render().splitlines() if line.startswith("| `")}
    assert "| live |" in rows["train.learning_rate"]
    assert "| restart |" in rows["train.batch_size"]
    assert "| security |" in rows["checkpoint.store_url"]
    assert "| deploy-time |" in rows["nats.url"]


@pytest.mark.parametrize(("field", "value"), [("r", 0), ("r", -4), ("alpha", 0), ("alpha", -1.0)])
def test_a_lora_rank_or_alpha_not_above_zero_is_refused_naming_the_field(tmp_path, model_dir, data_dir, field, value):
    path = write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", model={"lora": {field: value}})
    with pytest.raises(ConfigError, match=rf"model.lora.{field}: .*greater than 0"):
        load_config(path)


def test_lora_is_off_by_default_and_takes_its_documented_defaults_when_named(tmp_path, model_dir, data_dir):
    assert load_config(write_config(tmp_path / "a.yaml", model_dir, data_dir, tmp_path / "runs")).model.lora is None
    lora = load_config(
        write_config(tmp_path / "b.yaml", model_dir, data_dir, tmp_path / "runs", model={"lora": {"r": 8}})
    ).model.lora
    assert (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (
        8,
        32.0,
        0.0,
        ["q_proj", "k_proj", "v_proj", "o_proj"],
    )


def test_a_live_change_of_model_lora_is_refused_as_fixed_for_the_run(tmp_path, model_dir, data_dir):
    base = load_config(
        write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", model={"lora": {"r": 8}})
    )
    for settings in ({"model.lora": {"r": 16}}, {"model": {"lora": None}}, {"model.lora.r": 4}):
        with pytest.raises(ConfigError, match=r"model\.lora\.r: is fixed for the run \(new-run\)"):
            refuse_unsafe_live_change(base, base, settings)
    refuse_unsafe_live_change(base, base, {"model.lora": base.model.lora.model_dump(mode="json")})


def test_a_refused_secret_setting_is_named_without_its_value(tmp_path, model_dir, data_dir):
    path = write_config(
        tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", alerts={"webhook_url": 8675309123456}
    )
    with pytest.raises(ConfigError, match=r"alerts.webhook_url: Input should be a valid string") as refused:
        load_config(path)
    assert "8675309123456" not in str(refused.value)
