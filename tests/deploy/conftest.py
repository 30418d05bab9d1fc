"""The deployment tests' fixtures: the rendered k8s overlays (their helpers are in tests/support/deploy.py)."""

from __future__ import annotations

import pytest

from tests.support.deploy import OVERLAYS, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """Each overlay's manifests as `kubectl kustomize` renders them."""
    return {overlay: render(overlay) for overlay in OVERLAYS}
