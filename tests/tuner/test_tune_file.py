"""The tune file: refused at start with the key named; trial configs isolated from each other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.tuner.spec import TuneFileError
from services.tuner.tune_file import load_tune_file, trial_config_data
from tests.support.paths import ROOT
from tests.support.runs import config_file
from tests.support.tuner import tune_file

pytestmark = pytest.mark.integration


@pytest.fixture
def base(tmp_path: Path, tiny_model: tuple[Path, Path]) -> Path:
    return config_file(tmp_path, tiny_model, "base.yaml")


@pytest.mark.parametrize(
    ("space", "expected"),
    [
        ({"train.learnin_rate": {"type": "float", "low": 0.1, "high": 0.2}}, "space.train.learnin_rate: no such field"),
        ({"train.kl": {"type": "float", "low": 0.1, "high": 0.2}}, "space.train.kl: train.kl is a section"),
        (
            {"train.kl.coef": {"type": "float", "low": 0.2, "high": 0.2}},
            "space.train.kl.coef: empty range: low (0.2) must be below high (0.2)",
        ),
        ({"sampling.group_size": {"type": "int", "low": 8, "high": 2}}, "empty range: low (8) must be below high (2)"),
        ({"train.learning_rate": {"type": "float", "low": 0, "high": 1, "log": True}}, "a log range must be positive"),
        (
            {"sampling.temperature": {"type": "float", "low": 0, "high": 1}},
            "space.sampling.temperature: 0.0 is refused by the run config",
        ),
        ({"sampling.group_size": {"type": "float", "low": 2, "high": 8}}, "space.sampling.group_size: the field is an"),
        ({"run_id": {"type": "categorical", "choices": ["a", "b"]}}, "space.run_id: the tuner sets this per trial"),
        ({"train.algorithm": {"type": "categorical", "choices": ["grpo", "nope"]}}, "'nope' is refused by the run"),
        ({"train.lr": {"type": "uniform", "low": 0, "high": 1}}, "space.train.lr: Input tag 'uniform'"),
        (
            {"train.clip.high": {"type": "float", "low": 0.1, "high": 0.3, "when": {"param": "train.algo", "in": [1]}}},
            "space.train.clip.high.when.param: train.algo",
        ),
    ],
)
def test_a_bad_search_space_is_refused_naming_the_key(tmp_path, base, space, expected):
    with pytest.raises(TuneFileError) as refused:
        load_tune_file(tune_file(tmp_path, base, space=space))
    assert expected in str(refused.value), str(refused.value)


def test_every_problem_of_the_space_is_named_at_once(tmp_path, base):
    space = {
        "train.learnin_rate": {"type": "float", "low": 0.1, "high": 0.2},
        "sampling.temperature": {"type": "float", "low": 0.0, "high": 1.0},
    }
    with pytest.raises(TuneFileError) as refused:
        load_tune_file(tune_file(tmp_path, base, space=space))
    assert "space.train.learnin_rate" in str(refused.value) and "space.sampling.temperature" in str(refused.value)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"objective": {"metric": "eval_accuracy", "reduce": "median"}}, "objective.reduce: Input should be"),
        ({"pruner": {"kind": "hyperband"}}, "pruner.kind: Input should be"),
        ({"budget": {"max_trials": 0}}, "budget.max_trials: Input should be greater than or equal to 1"),
        ({"trial": {"max_rss_gb": -1}}, "trial.max_rss_gb: Input should be greater than 0"),
        ({"storage": "mysql://x"}, "storage: 'mysql://x' is not journal:PATH"),
        ({"objective": {"constraints": [{"metric": "kl_ref"}]}}, "give exactly one of below / above"),
        ({"enqueue": [{"train.kl.coef": 0.1}]}, "enqueue[0].train.kl.coef: not a parameter of the space"),
        ({"base_config": "/nonexistent.yaml"}, "base_config: config file '/nonexistent.yaml' does not exist"),
        ({"trail": {"max_steps": 3}}, "trail: Extra inputs are not permitted"),
        ({"fixed": {"data.eval_evry_steps": 5}}, "fixed.data.eval_evry_steps: no such field 'eval_evry_steps'"),
        ({"fixed": {"data.eval_every_steps": -1}}, "fixed.data.eval_every_steps: data.eval_every_steps: Input should"),
        ({"fixed": {"train.learning_rate": 0.1}}, "fixed.train.learning_rate: also in the space"),
        ({"parallel": {"device_slots": ["0,1", "1"]}}, "parallel.device_slots: slot '1' shares devices ['1']"),
        ({"parallel": {"device_slots": ["0 1"]}}, "parallel.device_slots: '0 1' is not a CUDA_VISIBLE_DEVICES"),
        ({"parallel": {"heartbeat_s": 10, "stale_after_s": 10}}, "parallel: stale_after_s (10) must exceed"),
        (
            {"objective": {"metric": "eval_acuracy"}},
            "objective.metric: eval_acuracy is not a metric the trainer writes",
        ),
        (
            {"objective": {"constraints": [{"metric": "reward/gsm8k/mean", "above": 0}, {"metric": "kl", "below": 1}]}},
            "objective.constraints[1].metric: kl is not a metric the trainer writes (docs/metrics.md lists them)",
        ),
        (
            {"objective": {"metric": "usage.price"}, "pruner": {"kind": "none"}},
            "objective.metric: usage.price is not a usage quantity (allowed: cost, cost_per_step,",
        ),
        (
            {"objective": {"metric": "usage.cost", "direction": "minimize"}, "pruner": {"kind": "none"}},
            "objective.metric: usage.cost needs prices: set cost.per_device_hour in the base config",
        ),
        (
            {"objective": {"metric": "usage.cpu_core_hours", "direction": "minimize"}},
            "pruner.kind: median cannot prune on usage.cpu_core_hours, which is known only when a trial has ended",
        ),
        (
            {"objective": {"constraints": [{"no_alert": "critical"}, {"metric": "usage.cost_per_step", "below": 1}]}},
            "objective.constraints[1].metric: usage.cost_per_step needs prices",
        ),
    ],
)
def test_a_bad_tune_file_is_refused_naming_the_key(tmp_path, base, fields, expected):
    with pytest.raises(TuneFileError) as refused:
        load_tune_file(tune_file(tmp_path, base, **fields))
    assert expected in str(refused.value), str(refused.value)


def test_a_priced_base_config_may_tune_for_cost_per_accuracy_point(tmp_path, tiny_model):
    priced = config_file(tmp_path, tiny_model, "priced.yaml", cost={"per_device_hour": {"cpu-core": 0.04}})
    objective = {"metric": "usage.cost_per_accuracy_point", "direction": "minimize"}
    spec, base = load_tune_file(tune_file(tmp_path, priced, objective=objective, pruner={"kind": "none"}))
    assert spec.objective.metric == "usage.cost_per_accuracy_point" and base.cost.per_device_hour == {"cpu-core": 0.04}


def test_rlpipe_tune_refuses_a_bad_file_before_any_trial_with_exit_2(tmp_path, base):
    path = tune_file(tmp_path, base, space={"train.learnin_rate": {"type": "float", "low": 0.1, "high": 0.2}})
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "tune", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "space.train.learnin_rate: no such field 'learnin_rate' in train" in done.stderr
    assert not (tmp_path / "tune").exists()  # nothing started, not even the study's storage


def test_a_trial_config_is_the_base_file_with_its_params_and_its_own_run_id_runs_dir_and_ports(tmp_path, base):
    fixed = {"data.eval_every_steps": 1}
    spec, cfg = load_tune_file(tune_file(tmp_path, base, trial={"max_steps": 3}, fixed=fixed))
    data = trial_config_data(spec, cfg, {"train.learning_rate": 5e-3, "train.kl.coef": 0.05}, "s-t7", tmp_path / "r")
    path = tmp_path / "t7.yaml"
    path.write_text(yaml.safe_dump(data))
    trial = load_config(path)  # what `rlpipe run` will load
    assert trial.run_id == "s-t7" and trial.run_dir == tmp_path / "r" / "s-t7"
    assert trial.train.learning_rate == 5e-3 and trial.train.kl.coef == 0.05
    assert trial.train.total_steps == 3  # base 4, capped by trial.max_steps
    assert trial.admin.port == 0  # two trials side by side never ask for the same admin port
    assert trial.data.eval_every_steps == 1  # the study's fixed settings
    assert trial.sampling.group_size == cfg.sampling.group_size  # the rest is the base file's
    # The base forks from the test worker's warm-start pool (tests/support/fixtures.py: warm_pool); a trial never
    # does: its roles stay in its own process group, which the tuner measures and kills.
    assert cfg.service.warm_start_pool is not None and trial.service.warm_start_pool is None


def test_a_mistyped_storage_url_is_refused_without_its_password(tmp_path, base):
    # postgres:// where postgresql:// is meant, the common typo: the refusal quotes the URL, never its password.
    with pytest.raises(TuneFileError, match=r"storage: 'postgres://tuner:<redacted>@db/optuna' is not") as refused:
        load_tune_file(tune_file(tmp_path, base), storage="postgres://tuner:PW-tune@db/optuna")
    assert "PW-tune" not in str(refused.value)
