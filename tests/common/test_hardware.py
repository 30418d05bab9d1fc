"""Hardware samples: the step-row keys they make, the gauges those become, and the GPU headroom alert on a CPU run."""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import subprocess
import sys

import pytest
import torch

from services.common.config import default_alert_rules
from services.common.observe.hardware import (
    GIB,
    ROW_METRICS,
    GpuReading,
    GpuWatch,
    HardwareSample,
    HardwareSampler,
    cuda_version_of,
    gpu_seen,
    host_rss_bytes,
    initialized_nvml,
    nvml_uuid,
    release_numbers,
    smi_cuda_version,
)
from services.common.observe.instruments import watch_gpus
from services.common.observe.metric_types import gauge_name
from services.common.observe.metrics import TRAINER_STEP_KEYS, check_row
from services.common.observe.usage import GPU, GpuHold, UsageMeter, gpu_holders
from services.trainer.alerts import AlertEvaluator
from tests.support.hardware import GPU_A, GPU_B
from tests.support.paths import ROOT
from tests.support.telemetry import minimal_config, one_value, scrape

pytestmark = pytest.mark.unit

FULL = HardwareSample(
    host_rss_gb=1.5,
    cuda_allocated_gb=10.0,
    cuda_reserved_gb=12.0,
    cuda_peak_gb=11.0,
    cuda_headroom_frac=0.25,
    gpu_util_pct=87.0,
    gpu_mem_used_gb=100.0,
    gpu_mem_total_gb=139.8,
)


def test_a_full_sample_names_every_key_as_the_issue_does():
    assert FULL.row() == {
        "memory/host_rss_gb": 1.5,
        "memory/allocated_gb": 10.0,
        "memory/reserved_gb": 12.0,
        "memory/peak_gb": 11.0,
        "memory/headroom_frac": 0.25,
        "gpu/util_pct": 87.0,
        "gpu/mem_used_gb": 100.0,
        "gpu/mem_total_gb": 139.8,
    }
    assert tuple(FULL.row()) == tuple(metric.key for metric in ROW_METRICS.values())
    check_row(FULL.row())


def test_missing_sources_leave_their_keys_out_not_zero():
    assert HardwareSample(host_rss_gb=2.0, cuda_allocated_gb=0.0).row() == {
        "memory/host_rss_gb": 2.0,
        "memory/allocated_gb": 0.0,
    }
    assert HardwareSample().row() == {}


def test_a_cpu_sampler_reports_only_this_process_rss_and_follows_it():
    sampler = HardwareSampler(torch.device("cpu"))
    before = sampler.row()
    assert list(before) == ["memory/host_rss_gb"]
    assert abs(before["memory/host_rss_gb"] * GIB - host_rss_bytes()) < 64 * 2**20
    # A mapping of its own: a heap block could reuse pages an earlier test in this worker freed, resident already.
    block = mmap.mmap(-1, 256 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1  # written, so resident
    grown = sampler.row()["memory/host_rss_gb"] - before["memory/host_rss_gb"]
    assert 0.2 < grown < 0.5, grown
    block.close()


def test_every_hardware_key_is_a_trainer_gauge_with_a_valid_unique_prometheus_name():
    assert set(FULL.row()) <= set(TRAINER_STEP_KEYS)
    names = [gauge_name(key) for key in TRAINER_STEP_KEYS]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name) for name in names)
    assert gauge_name("memory/headroom_frac") == "rlpipe_trainer_memory_headroom_frac"
    assert gauge_name("entropy") == "rlpipe_trainer_entropy"


def test_the_headroom_alert_is_not_judged_on_a_cpu_run_and_fires_after_three_low_steps():
    evaluator = AlertEvaluator(default_alert_rules(), cooldown_steps=0, now=0.0)
    sampler = HardwareSampler(torch.device("cpu"))
    for step in range(1, 11):  # a CPU run: rows never carry the metric
        assert evaluator.observe({"step": step, **sampler.row()}, now=float(step)) == []
    lows = [evaluator.observe({"step": step, "memory/headroom_frac": 0.03}, now=float(step)) for step in range(11, 14)]
    assert [[firing.rule for firing in fired] for fired in lows] == [[], [], ["gpu_memory_headroom"]]
    assert evaluator.observe({"step": 14, "memory/headroom_frac": 0.30}, now=14.0) == []
    assert [firing.rule for firing in evaluator.active] == []


def test_nvml_is_used_only_where_a_gpu_shows_itself():
    # The real bindings (nvidia-ml-py is a test dependency): without a driver nvmlInit fails and NVML counts as absent.
    import pynvml  # noqa: F401  an ImportError here means the test extra is not installed

    assert (initialized_nvml() is None) == (gpu_seen() == "")


def test_the_gpu_watch_reads_every_gpu_nvml_shows_with_its_load_and_memory(fake_nvml):
    watch = GpuWatch.open()
    assert watch.read() == [GPU_A, GPU_B]
    fake_nvml.GPUS[1] = (GPU_B.uuid, 64, 70 * GIB, 80 * GIB)  # read again at each call, not cached
    assert watch.read()[1] == GpuReading(1, GPU_B.uuid, 64.0, 70 * GIB, 80 * GIB)


def test_a_gpu_whose_query_fails_is_left_out_of_that_read_and_back_in_the_next(fake_nvml, monkeypatch):
    watch = GpuWatch.open()
    answers = fake_nvml.nvmlDeviceGetMemoryInfo

    def lost_second(handle):
        if handle == 1:
            raise fake_nvml.NVMLError("GPU is lost")
        return answers(handle)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetMemoryInfo", lost_second)
    assert watch.read() == [GPU_A]
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetMemoryInfo", answers)
    assert watch.read() == [GPU_A, GPU_B]


def test_no_gpu_watch_without_nvml_a_driver_or_a_gpu(fake_nvml, monkeypatch):
    monkeypatch.setattr(fake_nvml, "GPUS", [])
    assert GpuWatch.open() is None  # NVML loads but counts no GPU

    def no_driver():
        raise fake_nvml.NVMLError("Driver Not Loaded")

    monkeypatch.setattr(fake_nvml, "nvmlInit", no_driver)
    assert GpuWatch.open() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # the package not installed: the import fails
    assert GpuWatch.open() is None
    assert watch_gpus("rollout") is None  # and nothing is exported, without an error


def test_version_parsing():
    assert cuda_version_of(12080) == "12.8"
    assert cuda_version_of(13000) == "13.0"
    header = "| NVIDIA-SMI 580.159.03    Driver Version: 580.159.03    CUDA Version: 13.0     |"
    assert smi_cuda_version(header) == "13.0"
    assert smi_cuda_version("no header") is None
    assert release_numbers("2.27.5.post1") == (2, 27, 5)
    assert release_numbers("2.13.0+cu130") == (2, 13, 0)
    assert release_numbers("12.8") == (12, 8)
    assert nvml_uuid("58a0b5c3-1a2b-3c4d-5e6f-708192a3b4c5") == "GPU-58a0b5c3-1a2b-3c4d-5e6f-708192a3b4c5"
    assert nvml_uuid("MIG-58a0b5c3") == "MIG-58a0b5c3"


# A trainer's telemetry in its own process (the meter provider is set once per process), fed a CPU row and a
# full GPU-shaped row, then scraped over HTTP.
DRIVER = r"""
import json, sys
import torch
from services.common.config import load_config
from services.common.observe.hardware import HardwareSample, HardwareSampler
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.telemetry import start_telemetry

telemetry = start_telemetry(load_config(sys.argv[1]), "trainer", "trainer-test")
trainer = TrainerMetrics()
trainer.record_step({"step": 1, **HardwareSampler(torch.device("cpu")).row()})
trainer.record_step({"step": 2, **HardwareSample(**json.loads(sys.argv[2])).row()})
print(json.dumps({"metrics_url": telemetry.metrics_url}), flush=True)
sys.stdin.readline()
telemetry.shutdown()
"""


@pytest.mark.integration
def test_hardware_keys_reach_prometheus_under_their_mapped_names(tmp_path):
    config = minimal_config(tmp_path, telemetry={"metrics_port": 0})
    full = {name: getattr(FULL, name) for name in FULL.__dataclass_fields__}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(config), json.dumps(full)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = json.loads(driver.stdout.readline())["metrics_url"]
        samples = scrape(url)
    finally:
        driver.communicate("\n", timeout=60)
    assert driver.returncode == 0
    for key, value in FULL.row().items():
        assert math.isclose(one_value(samples, gauge_name(key)), value), key
    assert one_value(samples, "rlpipe_trainer_step") == 2


def test_what_nvml_refuses_is_left_out_of_the_gpu_holders_rather_than_raised(fake_nvml, monkeypatch):
    """Under some virtualised drivers NVML answers NOT_SUPPORTED or NO_PERMISSION; the launcher samples the holders
    from its loop every two seconds, so a refusal there would end the run."""
    rollout, trainer = 101, 202
    fake_nvml.PROCESSES = {0: [(rollout, 3 * GIB)], 1: [(trainer, 5 * GIB)]}

    def refused(*args):
        raise fake_nvml.NVMLError("NVML_ERROR_NOT_SUPPORTED")

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetGraphicsRunningProcesses", refused)
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetUtilizationRates", refused)
    assert gpu_holders() == {
        rollout: GpuHold(devices=1, mem_gib=3.0, util_pct=0.0),  # no utilisation figure: 0, as for an idle GPU
        trainer: GpuHold(devices=1, mem_gib=5.0, util_pct=0.0),
    }
    handle = fake_nvml.nvmlDeviceGetHandleByIndex
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetHandleByIndex", lambda index: refused() if index else handle(index))
    assert gpu_holders() == {rollout: GpuHold(devices=1, mem_gib=3.0, util_pct=0.0)}  # device 1 lost


def test_each_process_holding_gpus_is_read_with_its_device_memory_and_its_busiest_gpu(fake_nvml):
    rollout, reference, blind = 101, 202, 303
    fake_nvml.PROCESSES = {
        0: [(rollout, 30 * GIB), (reference, 2 * GIB), (blind, None)],
        1: [(rollout, 5 * GIB)],
    }
    assert gpu_holders() == {
        rollout: GpuHold(devices=2, mem_gib=35.0, util_pct=87.0),  # both GPUs, the busier one's utilisation
        reference: GpuHold(devices=1, mem_gib=2.0, util_pct=87.0),
        blind: GpuHold(devices=1, mem_gib=None, util_pct=87.0),  # NVML could not say: no figure rather than 0
    }

    # The meter keeps what a process held at the first step and at its last sample, and the busiest since.
    meter = UsageMeter()
    me = os.getpid()
    fake_nvml.PROCESSES = {1: [(me, 7 * GIB)]}
    meter.sample({me: "reference"}, now=0.0)
    meter.settle()
    fake_nvml.PROCESSES = {1: [(me, 9 * GIB)]}
    fake_nvml.GPUS[1] = (GPU_B.uuid, 64, 70 * GIB, 80 * GIB)
    meter.sample({me: "reference"}, now=10.0)
    fake_nvml.GPUS[1] = (GPU_B.uuid, 0, 70 * GIB, 80 * GIB)
    meter.sample({me: "reference"}, now=20.0)
    [trend] = meter.resource_trends()
    assert (trend.settled_gpu_gib, trend.last_gpu_gib, trend.gpu_util_peak_pct) == (7.0, 9.0, 64.0)
    assert meter.device_hours()["reference"][GPU] == pytest.approx(20 / 3600)
