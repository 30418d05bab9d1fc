"""Processes a run starts import only what their configured path needs.

Every whole-pipeline test starts a trainer, a rollout and the launcher, and the recovery tests restart them, so
an import paid on a path that never uses it is paid at every start. Deferred here: peft (LoRA only) in the trainer
and the transformers rollout, vLLM (backend vllm only) in the transformers rollout, matplotlib (the end-of-run
report only) in the launcher, torch and transformers in the launcher's start-up checks. Each check runs in a
fresh interpreter, since this test process may have imported any of them already; the reward role has its own
check in tests/reward/test_import_cost.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.support.runs import config_file

pytestmark = pytest.mark.integration

DEFERRED = ("peft", "vllm", "matplotlib")
LOADED = f"print(json.dumps({{'loaded': [name for name in {DEFERRED!r} if name in sys.modules]}}))\n"


def modules_after(script: str) -> dict:
    """What ``script`` prints as JSON on its last line, run in a fresh interpreter from the repository root."""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_one_process_full_weights_trainer_builds_its_policy_without_peft_vllm_or_matplotlib(tiny_model, tmp_path):
    config = config_file(tmp_path, tiny_model)
    found = modules_after(
        "import json, sys\n"
        # what `python -m services.trainer` imports (its __main__ starts the service on import)
        "import services.common.service, services.trainer.learning.distributed, services.trainer.role\n"
        "from services.common.config import load_config\n"
        "from services.trainer.learning.learner import Learner\n"
        f"learner = Learner(load_config({str(config)!r}))\n"
        "assert learner.cfg.model.lora is None and sum(p.numel() for p in learner.model.parameters()) > 0\n" + LOADED
    )
    assert found == {"loaded": []}


def test_a_transformers_rollout_generates_without_vllm_or_peft(tiny_model, tmp_path):
    config = config_file(tmp_path, tiny_model, rollout={"backend": "hf"})
    found = modules_after(
        "import json, sys\n"
        "import services.rollout.__main__\n"  # guarded: importing it starts nothing
        "from services.common.config import load_config\n"
        "from services.rollout.engines import HfEngine, build_engine\n"
        f"cfg = load_config({str(config)!r})\n"
        "engine = build_engine(cfg)\n"
        "assert isinstance(engine, HfEngine)\n"
        "[group] = engine.generate([engine.tokenizer.encode('1+2=')], cfg.sampling, cfg.train.max_seq_len)\n"
        "assert len(group) == cfg.sampling.group_size\n" + LOADED
    )
    assert found == {"loaded": []}


def test_the_launcher_imports_matplotlib_only_when_it_draws_the_report(tmp_path):
    metrics: Path = tmp_path / "metrics.jsonl"
    rows = [{"time": 1.0 + step, "step": step, "reward_mean": 0.5} for step in (1, 2)]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    found = modules_after(
        "import json, sys\n"
        "from pathlib import Path\n"
        "import services.cli.app, services.cli.launch.command\n"  # what `rlpipe run` imports before it starts the roles
        "from services.cli.report import render_report\n"
        "before = 'matplotlib' in sys.modules\n"
        f"png = render_report(Path({str(metrics)!r}), Path({str(tmp_path / 'report.png')!r}))\n"
        "after = 'matplotlib' in sys.modules\n"
        "print(json.dumps({'before': before, 'after': after, 'png': png.read_bytes()[:4].hex()}))\n"
    )
    assert found == {"before": False, "after": True, "png": b"\x89PNG".hex()}


def test_the_launchers_start_up_checks_import_neither_torch_nor_transformers_where_no_gpu_shows(tiny_model, tmp_path):
    """The checks read the model's config and tokenizer files and ask torch about CUDA only where a GPU shows:
    importing torch and transformers would cost each run's launcher seconds of CPU before anything starts."""
    from services.common.observe.hardware import gpu_seen

    config = config_file(tmp_path, tiny_model)
    found = modules_after(
        "import json, sys\n"
        "import services.cli.app, services.cli.launch.command\n"
        "from services.common.config import load_config\n"
        "from services.common.startup_checks.roles import startup_checks\n"
        f"rows = startup_checks(load_config({str(config)!r}), 'run')\n"
        "print(json.dumps({'checks': sorted({row.name for row in rows if row.status != 'fail'}),\n"
        "                  'loaded': [name for name in ('torch', 'transformers') if name in sys.modules]}))\n"
    )
    assert found["checks"] == sorted(
        [
            "model",
            "device",
            "dataset data.train_path",
            "dataset data.eval_path",
            "storage",
            "admin token",
            "weight-sync token",
            "ports",
        ]
    )
    assert found["loaded"] == (["torch"] if gpu_seen() else [])
