"""Every example config in examples/ runs: `rlpipe run --smoke` of each run config as it is written, but for the
tiny test model (and reward model) and its data in place of the models and data `make demo` builds, and a study
spec's base config is one of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from services.cli.verify.smoke import smoke_overrides
from tests.support.paths import ROOT
from tests.support.runs import WARM_POOL, metric_rows, rlpipe_command

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def is_study(path: Path) -> bool:
    """A tuning study spec (`rlpipe tune`), not a run config: it names a base config instead of a model."""
    return "study" in yaml.safe_load(path.read_text())


RUN_EXAMPLES = [path for path in EXAMPLES if not is_study(path)]


# The lengths a config sets, scaled down together where the tiny model has fewer positions than the example's model.
ROLLOUT_LENGTHS = ("max_total_tokens", "max_tokens_per_turn", "max_observation_tokens")


def on_the_tiny_model(example: Path, folder: Path, tiny_model, reward_model: Path | None) -> Path:
    """``example`` with only what this machine lacks replaced: the model and reward model folders, the data files,
    the runs folder (under ``folder``), and sequence lengths past the tiny model's positions, scaled down to them;
    every other setting is the example's own."""
    model_dir, data_dir = tiny_model
    config = yaml.safe_load(example.read_text())
    config["runs_dir"] = str(folder / "runs")
    config["model"]["path"] = str(model_dir)
    config["data"] |= {"train_path": str(data_dir / "train.jsonl"), "eval_path": str(data_dir / "eval.jsonl")}
    if "model" in config.get("reward", {}):
        config["reward"]["model"]["path"] = str(reward_model)
    positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    longest = config["train"]["max_seq_len"]
    if longest > positions:
        config["train"]["max_seq_len"] = positions
        config["sampling"]["max_new_tokens"] = config["sampling"]["max_new_tokens"] * positions // longest
        for key in set(ROLLOUT_LENGTHS) & set(config["rollout"]):
            config["rollout"][key] = config["rollout"][key] * positions // longest
    if WARM_POOL:  # the roles fork from this worker's pool, as the other runs over the tiny model do
        config.setdefault("service", {})["warm_start_pool"] = str(WARM_POOL[0])
    path = folder / example.name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.unit
def test_each_study_spec_in_the_examples_tunes_one_of_the_run_examples():
    studies = [path for path in EXAMPLES if is_study(path)]
    assert studies, "the examples hold a study spec: this test would pass vacuously without one"
    for study in studies:
        base = ROOT / yaml.safe_load(study.read_text())["base_config"]
        assert base in RUN_EXAMPLES, f"{study.name} tunes {base}, which is not a run example smoke-tested here"


@pytest.mark.e2e
@pytest.mark.parametrize("example", RUN_EXAMPLES, ids=[path.stem for path in RUN_EXAMPLES])
def test_each_example_run_config_passes_a_smoke_run_with_its_own_settings(example, tiny_model, request, tmp_path):
    reward_model = None
    if "model" in yaml.safe_load(example.read_text()).get("reward", {}):
        reward_model, _ = request.getfixturevalue("tiny_reward_model")
    config = on_the_tiny_model(example, tmp_path, tiny_model, reward_model)
    done = rlpipe_command("run", "--smoke", str(config), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    smoke = next(line for line in done.stdout.splitlines() if "smoke-run" in line)
    assert "pass" in smoke and all(stage in smoke for stage in ("sampling", "reward", "reference", "update 3 steps"))
    written = yaml.safe_load(example.read_text())
    run_dir = tmp_path / "runs" / f"{written['run_id']}-smoke"
    assert [row.step for row in metric_rows(run_dir) if row.is_step] == [1, 2, 3]
    # The run trained with the example's own settings, not the defaults: its algorithm, rewards and rollout (but for
    # what the smoke run sets itself, and the lengths the tiny model bounds).
    ran = yaml.safe_load((run_dir / "effective-config.yaml").read_text())
    assert ran["train"]["algorithm"] == written["train"]["algorithm"]
    assert ran["reward"]["functions"] == written["reward"]["functions"]
    smoke_sets = {key.removeprefix("rollout.") for key in smoke_overrides(written["run_id"])}
    rollout = {key: value for key, value in written["rollout"].items() if key not in {*smoke_sets, *ROLLOUT_LENGTHS}}
    assert {key: ran["rollout"][key] for key in rollout} == rollout
