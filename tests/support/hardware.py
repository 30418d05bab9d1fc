"""NVML faked in process: two GPUs with known load and memory (tests/common/fake_nvml/pynvml.py), for code that
reads GPUs through ``pynvml`` on a machine without one."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from services.common.observe.hardware import GIB, GpuReading
from tests.support.paths import ROOT

FAKE_NVML = ROOT / "tests" / "common" / "fake_nvml" / "pynvml.py"
# What the fake reports for its two GPUs.
GPU_A = GpuReading(0, "GPU-00000000-0000-0000-0000-00000000000a", 87.0, 100 * GIB, 140 * GIB)
GPU_B = GpuReading(1, "GPU-00000000-0000-0000-0000-00000000000b", 3.0, 7 * GIB, 80 * GIB)


@pytest.fixture
def fake_nvml(monkeypatch):
    """The fake NVML in place of pynvml for this test: what ``initialized_nvml`` imports."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_NVML)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module
