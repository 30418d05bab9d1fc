"""Shared by the deployment tests: where the deploy files are, and the rendered k8s overlays."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("dev", "prod")
# Where deploy/install-kubectl.sh (run by `make install` and .ci/run) puts the pinned kubectl.
PINNED_KUBECTL = ROOT / "build" / "tools" / "bin" / "kubectl"


def kubectl() -> str:
    found = str(PINNED_KUBECTL) if PINNED_KUBECTL.is_file() else shutil.which("kubectl")
    if not found:
        pytest.fail("no kubectl: run `sh deploy/install-kubectl.sh` (`make install` does)")
    return found


def render(overlay: str) -> list[dict]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """Each overlay's manifests as `kubectl kustomize` renders them."""
    return {overlay: render(overlay) for overlay in OVERLAYS}


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def trainer(docs: list[dict]) -> dict:
    """The trainer's workload: the base's StatefulSet, or the Job of components/trainer-job (the prod overlay)."""
    found = find(docs, "StatefulSet", "trainer") + find(docs, "Job", "trainer")
    assert len(found) == 1, f"expected one trainer workload, found {[d['kind'] for d in found]}"
    return found[0]


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())
