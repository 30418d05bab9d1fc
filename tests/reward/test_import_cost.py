"""A reward replica imports torch and transformers only when it scores with a reward model.

Every run starts one, and with rule rewards alone (the default) those imports were about 5 CPU seconds of its
start-up, paid again by its rule sandbox's child, which imports the replica's main module anew. Each check runs in
a fresh interpreter: this test process may have imported torch already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.integration

HEAVY = ("torch", "transformers", "vllm")


def modules_after(script: str) -> dict:
    """What ``script`` prints as JSON on its last line, run in a fresh interpreter from the repository root."""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_rule_and_http_scored_replica_never_imports_torch_transformers_or_vllm():
    found = modules_after(
        "import json, sys\n"
        "import services.reward.__main__\n"  # what `python -m services.reward` imports, and its sandbox child again
        "from services.common.config import RewardConfig\n"
        "from services.reward.service import RewardSources\n"
        "reward = RewardConfig(functions={'exact_match': 1.0, 'format': 0.5}, http={'url': 'http://127.0.0.1:9/s'})\n"
        "sources = RewardSources.of(reward, torch_threads=1)\n"
        "assert sources.model is None and sources.remote is not None\n"
        f"print(json.dumps({{'loaded': [name for name in {HEAVY!r} if name in sys.modules]}}))\n"
    )
    assert found == {"loaded": []}


def test_a_replica_with_a_reward_model_imports_torch_and_caps_its_threads(tiny_reward_model):
    model_dir: Path = tiny_reward_model[0]
    found = modules_after(
        "import json, sys\n"
        "import services.reward.__main__\n"
        "from services.common.config import RewardConfig\n"
        "from services.reward.service import RewardSources\n"
        f"reward = RewardConfig(model={{'path': {str(model_dir)!r}, 'device': 'cpu'}})\n"
        "sources = RewardSources.of(reward, torch_threads=2)\n"
        "import torch\n"
        "print(json.dumps({'scores': len(sources.model.score([('1+1=', '2')])), 'threads': torch.get_num_threads()}))\n"
    )
    assert found == {"scores": 1, "threads": 2}
