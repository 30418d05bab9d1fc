"""`rlpipe run CONFIG KEY=VALUE ...` and `rlpipe tune FILE KEY=VALUE ...`: dotted overrides on the command line."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from services.common.config import ConfigError, load_config_with, parse_overrides
from services.common.observe import metrics as m
from tests.support.paths import ROOT
from tests.support.runs import LIGHT_RUN, RLPIPE_RUN, config_file, metric_rows

pytestmark = pytest.mark.integration


def rlpipe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


BAD_OVERRIDES = [
    ("train.learing_rate=1e-4", "override train.learing_rate: no such field (allowed here: ["),
    ("train.learning_rate=-1", "invalid override: train.learning_rate: Input should be greater than 0"),
    ("learning_rate", "override 'learning_rate' is not KEY=VALUE"),
]


@pytest.mark.parametrize(
    ("command", "override", "refusal"),
    [
        *((["run"], override, f"rlpipe run: {refusal}") for override, refusal in BAD_OVERRIDES),
        *((["verify", "--config"], override, f"rlpipe verify: {refusal}") for override, refusal in BAD_OVERRIDES),
        (["verify", "--config"], "train.total_steps=50", "rlpipe verify: override train.total_steps: set by the smoke"),
    ],
)
def test_a_bad_override_is_refused_in_one_line_naming_it_before_anything_starts(
    command, override, refusal, tiny_model, tmp_path
):
    config = config_file(tmp_path, tiny_model)
    done = rlpipe(*command, str(config), override)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(refusal), line
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_an_override_an_environment_variable_would_undo_is_refused(tiny_model, tmp_path):
    config = config_file(tmp_path, tiny_model)
    done = rlpipe("run", str(config), "train.learning_rate=5e-5", env={"RLPIPE_TRAIN__LEARNING_RATE": "1e-3"})
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "rlpipe run: override train.learning_rate: an RLPIPE_* environment variable sets it too and would win; "
        "unset it or drop the override"
    )


@pytest.mark.integration
def test_overrides_are_read_as_yaml_and_written_into_the_file_data(tiny_model, tmp_path):
    config = config_file(tmp_path, tiny_model)
    overrides = parse_overrides(
        ["train.learning_rate=5e-5", "reward.functions={exact_match: 0.5, format: 0.5}", "run_id=variant-2"]
    )
    cfg, data = load_config_with(config, overrides)
    assert (cfg.train.learning_rate, cfg.reward.functions, cfg.run_id) == (
        5e-5,
        {"exact_match": 0.5, "format": 0.5},
        "variant-2",
    )
    # The file's own settings stay as written beside the overrides, each as typed (YAML reads 5e-5 as text).
    assert data["train"]["total_steps"] == 4 and data["train"]["learning_rate"] == "5e-5"
    with pytest.raises(ConfigError, match=r"^override sampling.top_p: value '\[0.5' is not valid YAML: "):
        parse_overrides(["sampling.top_p=[0.5"])
    with pytest.raises(
        ConfigError, match=r"^override train.kl.nope: no such field \(allowed here: \['coef', 'estimator'"
    ):
        load_config_with(config, {"train.kl.nope": 1})


@pytest.mark.e2e
def test_a_run_with_overrides_trains_with_them_and_records_them_in_its_effective_config(tiny_model, tmp_path):
    config = config_file(tmp_path, tiny_model, **LIGHT_RUN)
    done = subprocess.run(
        [
            *RLPIPE_RUN,
            str(config),
            "run_id=variant",
            "train.total_steps=2",
            "train.learning_rate=2e-4",
            "service.role_torch_threads={trainer: 2}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "variant"
    assert not (tmp_path / "runs" / "test").exists()
    steps = [row for row in metric_rows(run_dir) if row.is_step]
    assert [row.step for row in steps] == [1, 2]
    assert steps[0][m.LEARNING_RATE] > 0
    effective = yaml.safe_load((run_dir / "effective-config.yaml").read_text())
    assert (effective["run_id"], effective["train"]["total_steps"], effective["train"]["learning_rate"]) == (
        "variant",
        2,
        2e-4,
    )
    assert yaml.safe_load((run_dir / "run-config.yaml").read_text())["train"]["total_steps"] == 2
    # The trainer computes with the threads its role was given; the other roles keep service.torch_threads.
    startup = [json.loads(line) for line in (run_dir / "startup.jsonl").read_text().splitlines()]
    threads = {row["component"]: row["torch_threads"] for row in startup if "torch_threads" in row}
    assert threads == {"trainer": 2, "reference-0": 1, "rollout-0": 1, "reward-0": 1}, startup


def test_tune_overrides_its_base_config_and_refuses_a_searched_key(tiny_model, tmp_path):
    # The example's search space over a base config on the test model (a fresh clone has no models/ yet),
    # in its own, empty study.
    base = config_file(tmp_path, tiny_model, "base.yaml")
    spec = yaml.safe_load((ROOT / "examples" / "tune-arith.yaml").read_text())
    tune_file = tmp_path / "tune.yaml"
    tune_file.write_text(yaml.safe_dump({**spec, "base_config": str(base), "workdir": str(tmp_path / "tune")}))
    done = rlpipe("tune", "status", str(tune_file), "train.total_steps=40", "sampling.top_p=0.9")
    assert done.returncode == 0, done.stderr
    done = rlpipe("tune", "status", str(tune_file), "train.learning_rate=1e-3")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "rlpipe tune: override train.learning_rate: the tune file searches it; a key is either set or searched"
    )
    done = rlpipe("tune", "status", str(tune_file), "train.total_steps=0")
    assert done.returncode == 2
    assert done.stderr.strip().startswith(
        "rlpipe tune: invalid override: train.total_steps: Input should be greater than or equal to 1"
    )
