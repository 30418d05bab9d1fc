"""Each role's GPU memory, accounted: what one process holds (torch's counters, NVML's per-process figure), its
presence entry, the trainer's step rows and status, `rlpipe status` and the report (observe/gpu_memory.py).

There is no GPU here: torch's counters are handed in through the reader's parameter and NVML is the fake module
(tests/common/fake_nvml), never torch patched globally."""

from __future__ import annotations

import asyncio
import io
import os

import nats
import pytest
from rich.console import Console

from services.cli.admin import views as admin
from services.cli.report import render_html
from services.common.config import BuildInfo
from services.common.observe import metrics as m
from services.common.observe.events import EventLog, Journal
from services.common.observe.gpu_memory import (
    CudaMemory,
    ProcessGpuMemory,
    memory_lines,
    process_gpu_memory,
    torch_cuda_memory,
)
from services.common.observe.records import metrics_rows
from services.common.observe.usage import GpuHold
from services.common.pb import admin_pb2
from services.common.transport.presence import Presence, SeenService, read_presence, role_gpu_memory
from services.trainer.alerts import AlertEvaluator
from services.trainer.control import Control
from services.trainer.intake.ledger import GroupLedger
from services.trainer.progress import Progress
from services.trainer.status import StatusReporter
from tests.support.records import T0, report_section, write_jsonl
from tests.support.runs import run_config
from tests.support.trainer import Holds

pytestmark = pytest.mark.unit
GIB = 2**30
ME = os.getpid()


def test_a_process_reports_torchs_counters_and_the_memory_nvml_lists_for_it():
    memory = process_gpu_memory(
        ME,
        cuda=lambda: CudaMemory(allocated=3 * GIB, reserved=4 * GIB),
        holders=lambda: {ME: GpuHold(devices=1, mem_gib=4.5, util_pct=50.0), 999_999: GpuHold(1, 9.0, 50.0)},
    )
    assert memory == ProcessGpuMemory(allocated=3 * GIB, reserved=4 * GIB, used=int(4.5 * GIB))
    assert memory.gib() == {"allocated_gb": 3.0, "reserved_gb": 4.0, "used_gb": 4.5}  # another pid's 9 not counted


def test_a_figure_whose_source_is_missing_is_absent_never_zero_or_short():
    cpu = process_gpu_memory(ME, cuda=lambda: None, holders=dict)
    assert cpu == ProcessGpuMemory() and cpu.gib() == {}
    unknown = process_gpu_memory(ME, cuda=lambda: None, holders=lambda: {ME: GpuHold(1, None, 0.0)})
    assert unknown.used is None  # NVML cannot tell this process's memory (some containers): no figure


def test_reading_torchs_counters_on_a_process_without_cuda_creates_no_context():
    assert torch_cuda_memory() is None  # CUDA not initialized here (no GPU): asking must not initialize it


def entry(instance: str, role: str, up: bool, gpu: dict[str, float]) -> SeenService:
    return SeenService(
        role=role, instance=instance, time=T0, last_seen_s=1.0, up=up, restarts=0, gpu_memory=gpu
    )  # fmt: skip


def test_the_step_row_sums_each_roles_live_replicas_figure_by_figure():
    entries = [
        entry("rollout-0", "rollout", True, {"allocated_gb": 1.0, "reserved_gb": 1.5, "used_gb": 2.0}),
        entry("rollout-1", "rollout", True, {"allocated_gb": 1.25, "reserved_gb": 1.5, "used_gb": 2.5}),
        entry("rollout-2", "rollout", False, {"allocated_gb": 9.0}),  # down: its last figures are stale
        entry("trainer", "trainer", True, {"used_gb": 3.0}),  # NVML only: torch not initialized there
        entry("reward-0", "reward", True, {}),  # a CPU replica
    ]
    assert role_gpu_memory(entries) == {
        "memory/rollout/allocated_gb": 2.25,
        "memory/rollout/reserved_gb": 3.0,
        "memory/rollout/used_gb": 4.5,
        "memory/trainer/used_gb": 3.0,
    }
    assert m.undeclared(role_gpu_memory(entries)) == []  # each a member of the contract's m.ROLE_GPU_MEMORY


def status_cells(services: list[admin_pb2.ServiceStatus]) -> dict[str, dict[str, str]]:
    """`rlpipe status`'s services table: instance -> column -> cell."""
    out = io.StringIO()
    admin.console, was = Console(file=out, width=300), admin.console
    try:
        admin.show_status(admin_pb2.Status(run_id="r", services=services), as_json=False)
    finally:
        admin.console = was
    table = out.getvalue().split("services")[-1]
    lines = [[cell.strip() for cell in line.split("┃" if "┃" in line else "│")[1:-1]] for line in table.splitlines()]
    header, *body = [cells for cells in lines if len(cells) > 3]
    return {cells[0]: dict(zip(header, cells, strict=True)) for cells in body}


def test_rlpipe_status_shows_each_replicas_gpu_memory_and_a_dash_for_a_cpu_one():
    cells = status_cells(
        [
            admin_pb2.ServiceStatus(
                instance="rollout-0", role="rollout", gpu_allocated_gib=1.5, gpu_reserved_gib=2, gpu_used_gib=2.6
            ),
            admin_pb2.ServiceStatus(instance="reward-0", role="reward"),
            admin_pb2.ServiceStatus(instance="trainer", role="trainer", gpu_used_gib=0.75),
        ]
    )
    gpu = {instance: row["GPU GiB alloc/resv/used"] for instance, row in cells.items()}
    assert gpu == {"rollout-0": "1.50 / 2.00 / 2.60", "reward-0": "-", "trainer": "- / - / 0.75"}


def test_rlpipe_status_lists_a_replica_that_ended_in_order_as_stopped_and_a_silent_one_as_down():
    cells = status_cells(
        [
            admin_pb2.ServiceStatus(instance="rollout-0", role="rollout", up=True),
            admin_pb2.ServiceStatus(instance="rollout-1", role="rollout", stopped=True),  # scaled in
            admin_pb2.ServiceStatus(instance="rollout-2", role="rollout"),  # killed
        ]
    )
    assert {instance: row["up"] for instance, row in cells.items()} == {
        "rollout-0": "up",
        "rollout-1": "stopped",
        "rollout-2": "down",
    }


def test_the_report_tabulates_and_plots_each_roles_gpu_memory_and_a_cpu_run_has_no_such_section(tmp_path):
    memory = {"memory/trainer/allocated_gb": 2.0}
    rows = [
        {"time": T0 + step, "step": step, "reward_mean": 0.1, "memory/rollout/used_gb": used, **memory}
        for step, used in ((1, 1.0), (2, 3.0), (3, 2.0))
    ]
    assert memory_lines(metrics_rows(rows)) == [
        ("GPU GiB: trainer", "allocated peak 2.00, last 2.00"),
        ("GPU GiB: rollout", "used peak 3.00, last 2.00"),
    ]
    run_dir = tmp_path / "run"
    section = report_section(run_dir, rows, "GPU memory per role")
    assert "data:image/png;base64," in section
    assert "<td>GPU GiB: rollout</td><td>used peak 3.00, last 2.00</td>" in section
    write_jsonl(run_dir / "metrics.jsonl", [{k: v for k, v in row.items() if "memory" not in k} for row in rows])
    assert "GPU memory per role" not in render_html(run_dir).read_text()


@pytest.mark.integration
def test_replicas_figures_reach_the_trainers_status_and_step_row_through_their_presence_entries(
    tiny_model, tmp_path, nats_url
):
    cfg = run_config(tmp_path, tiny_model, run_id="mem", nats={"url": nats_url})
    figures = {
        "rollout-0": ProcessGpuMemory(allocated=GIB, reserved=2 * GIB, used=3 * GIB),
        "rollout-1": ProcessGpuMemory(allocated=GIB // 2, reserved=GIB, used=GIB),
        "reference-0": ProcessGpuMemory(),  # on a CPU
    }

    async def no_catalog() -> list[dict]:
        return []

    async def scenario() -> tuple[admin_pb2.Status, dict[str, float]]:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await read_presence(js, cfg.run_id, cfg.nats)  # the trainer's read creates the bucket
        replicas = []
        for name, memory in figures.items():
            named = cfg.model_copy(update={"service": cfg.service.model_copy(update={"instance": name})})
            replicas.append(await Presence(js, named, name.split("-")[0], gpu_memory=lambda m=memory: m).start())
        progress = Progress()
        control = Control(Holds(), Journal(EventLog(tmp_path / "events.jsonl")), progress)
        settings = type("Settings", (), {"cfg": cfg, "version": 1})()
        bus = type("Bus", (), {"js": js})()
        reporter = StatusReporter(
            settings, bus, progress, control, GroupLedger(), AlertEvaluator([], 0), no_catalog, BuildInfo()
        )
        status, row = await reporter.status(), await reporter.health_row()
        for replica in replicas:
            await replica.stop()
        await nc.close()
        return status, row

    status, row = asyncio.run(scenario())
    by_name = {s.instance: s for s in status.services}
    rollout = by_name["rollout-0"]
    assert (rollout.gpu_allocated_gib, rollout.gpu_reserved_gib, rollout.gpu_used_gib) == (1.0, 2.0, 3.0)
    assert (by_name["reference-0"].gpu_used_gib, by_name["reference-0"].gpu_allocated_gib) == (0.0, 0.0)
    memory = {key: value for key, value in row.items() if key.startswith("memory/")}
    assert memory == {
        "memory/rollout/allocated_gb": 1.5,
        "memory/rollout/reserved_gb": 3.0,
        "memory/rollout/used_gb": 4.0,
    }
