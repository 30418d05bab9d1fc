from pathlib import Path

import pytest

from tests.support.paths import TEST_MODEL_DIR, one_builder


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_model) -> tuple[Path, dict]:
    """The tiny arithmetic reward model, trained once from the tiny policy (reused while its settings match)."""
    from services.cli.build.tiny_reward_model import build_reward_model

    model_dir, data_dir = tiny_model
    out = TEST_MODEL_DIR / "reward-model"
    with one_builder("reward-model"):
        return out, build_reward_model(out, model_dir, data_dir, seed=0)
