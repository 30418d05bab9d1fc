"""`rlpipe run` with a broken config ends in one short report naming every problem, never a traceback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.paths import ROOT
from tests.support.runs import RLPIPE_RUN

pytestmark = pytest.mark.integration


def run_cli(config: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")} | env
    return subprocess.run(
        [*RLPIPE_RUN, str(config)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=environment
    )


def test_config_that_is_not_yaml_ends_the_run_with_one_line_naming_file_line_and_column(tmp_path: Path):
    config = tmp_path / "broken.yaml"
    config.write_text("run_id: broken\nmodel: {path: models/x}\nreward:\n  functions: [exact_match\n")

    done = run_cli(config)

    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    report = done.stderr.strip().splitlines()
    assert len(report) == 1, done.stderr
    assert str(config) in report[0]
    # The parser stops at the end of the file (line 5) and names the unclosed `[` (line 4, column 14).
    assert "not valid YAML at line 5, column 1" in report[0]
    assert "flow sequence that starts at line 4, column 14" in report[0]


def test_every_problem_of_a_config_is_named_in_one_run_environment_mismatch_included(tmp_path: Path):
    config = tmp_path / "prod.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "environment": "prod",
                "model": {"path": str(tmp_path / "no-model")},
                "data": {"train_path": str(tmp_path / "no-train.jsonl")},
                "train": {"learning_rate": -1},
            }
        )
    )

    done = run_cli(config, RLPIPE_ENV="test")

    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    problems = [line.strip().split(":")[0] for line in done.stderr.splitlines()[1:]]
    assert problems == ["model.path", "data.train_path", "train.learning_rate", "environment"], done.stderr
    assert "this config is for 'prod' but RLPIPE_ENV is 'test'" in done.stderr


def test_shipped_prod_config_under_the_test_environment_names_the_mismatch_beside_missing_paths():
    done = run_cli(ROOT / "deploy" / "config" / "prod.yaml", RLPIPE_ENV="test")

    assert done.returncode == 2
    assert "model.path: model folder '/models/smollm2-135m-instruct' does not exist" in done.stderr
    assert "environment: this config is for 'prod' but RLPIPE_ENV is 'test'" in done.stderr
