"""`model.device: cuda` on a machine without a GPU is refused before the service loads anything."""

import pytest
import torch

from services.common.startup_checks.roles import startup_checks
from services.common.startup_checks.rows import StartupCheckError
from tests.support.runs import run_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("role", ["trainer", "reference", "run"])
def test_cuda_without_a_gpu_fails_the_start_up_checks_naming_the_field(tiny_model, tmp_path, role):
    cfg = run_config(tmp_path, tiny_model, model={"device": "cuda"})
    if torch.cuda.is_available():  # a GPU machine (the device check script): cuda is a valid choice there
        assert {r.name: r.status for r in startup_checks(cfg, role)}["device"] == "ok"
        return
    with pytest.raises(StartupCheckError) as refused:
        startup_checks(cfg, role)
    failed = {r.name: r.detail for r in refused.value.failures if r.name != "admin token"}  # no token set here
    assert list(failed) == ["device"]
    assert "model.device: 'cuda'" in failed["device"]


def test_auto_picks_the_cpu_here(tiny_model, tmp_path):
    cfg = run_config(tmp_path, tiny_model)
    rows = {r.name: r for r in startup_checks(cfg, "reference")}
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert (rows["device"].status, rows["device"].detail) == ("ok", f"model.device auto: {expected}")
