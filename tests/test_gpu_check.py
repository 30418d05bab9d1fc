"""bench/gpu_check.sh, as far as a machine without a GPU can take it: it parses, and its plan is the one documented."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "bench" / "gpu_check.sh"
STEPS = [
    "nvidia-smi", "build-tiny", "doctor", "hardware", "vllm", "bf16-trainer", "weight-sync", "torchrun-2", "smol",
    "shared-gpu",
]  # fmt: skip
BENCHES = ["vs-trl-gpu", "long-tail-gpu", "hf-static-gpu"]  # run only when --only names them


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stderr) == (0, "")


def test_dry_run_prints_every_step_with_its_limit_and_runs_nothing(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    benches_at = lines.index("benches, run only when --only names them:")
    rows = [re.match(r"(\S+)\s+(\d+)s  ", line) for line in lines[1 : benches_at - 1]]
    assert [row.group(1) for row in rows] == STEPS
    assert [re.match(r"(\S+)\s+\d+s  ", line).group(1) for line in lines[benches_at + 1 :]] == BENCHES
    limits = [int(row.group(2)) for row in rows]
    # Ceilings, not estimates: with one GPU (no torchrun) the checks stay within 1000 s; a device session shorter
    # than that runs some of them (--only), as it does the benches.
    assert sum(limits) - limits[STEPS.index("torchrun-2")] <= 1000
    assert lines[benches_at - 1] == f"at most {sum(limits)}s in all, plus building the venv when there is none"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_every_step_in_the_docs_table():
    section = (ROOT / "docs" / "performance.md").read_text().split("## GPU check", 1)[1]
    assert "bench/gpu_check.sh" in section
    for step in STEPS + BENCHES:
        assert f"| {step} |" in section, step


def test_an_unknown_argument_is_refused():
    done = subprocess.run(["bash", str(SCRIPT), "--gpus"], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stderr) == (2, "gpu_check.sh: unknown argument --gpus\n")
