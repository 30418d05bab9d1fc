"""Device-hours per role from the processes' own counts, and what they cost."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from services.common.observe.usage import (
    CPU_CORE,
    GPU,
    GpuHold,
    RunCost,
    UsageMeter,
    process_cpu_seconds,
    process_rss_gib,
    with_descendants,
)

pytestmark = pytest.mark.unit


def test_cost_is_priced_per_device_hour_per_step_and_per_accuracy_point():
    cost = RunCost(
        device_hours={"trainer": {CPU_CORE: 2.0, GPU: 1.5}, "rollout": {CPU_CORE: 1.0, GPU: 0.5}},
        prices={CPU_CORE: 0.05, GPU: 2.0},
        steps=40,
        accuracy_gain=0.25,
    )
    assert cost.total == pytest.approx(3.0 * 0.05 + 2.0 * 2.0)
    assert cost.per_step == pytest.approx(4.15 / 40)
    assert cost.per_accuracy_point == pytest.approx(4.15 / 25)  # 0.25 accuracy is 25 points
    assert cost.lines() == [
        ("device-hours: rollout", "1.0000 cpu-core-h, 0.5000 gpu-h"),
        ("device-hours: trainer", "2.0000 cpu-core-h, 1.5000 gpu-h"),
        ("cost", "4.1500"),
        ("cost per step", "0.103750"),
        ("cost per held-out accuracy point", "0.1660"),
    ]


def test_a_run_using_an_unpriced_device_kind_has_no_cost_and_says_which_kinds_are_priced():
    cost = RunCost({"trainer": {CPU_CORE: 1.0, GPU: 1.0}}, {CPU_CORE: 0.05}, steps=10, accuracy_gain=0.1)
    assert cost.total is None and cost.per_step is None and cost.per_accuracy_point is None
    assert cost.lines()[-1] == ("cost", "not priced (cost.per_device_hour has cpu-core)")
    # A kind the run did not use needs no price.
    assert RunCost({"trainer": {CPU_CORE: 1.0, GPU: 0.0}}, {CPU_CORE: 0.05}, 10, 0.1).total == pytest.approx(0.05)


def test_no_held_out_gain_leaves_the_cost_per_point_undefined():
    for gain in (None, 0.0, -0.05):
        cost = RunCost({"trainer": {CPU_CORE: 1.0, GPU: 0.0}}, {CPU_CORE: 1.0}, steps=5, accuracy_gain=gain)
        assert cost.per_accuracy_point is None
        assert cost.lines()[-1] == ("cost per held-out accuracy point", "no held-out gain")


def test_the_meter_sums_every_process_of_a_role_and_counts_held_gpus_by_wall_time():
    meter = UsageMeter()
    me = os.getpid()
    two = GpuHold(devices=2, mem_gib=10.0, util_pct=50.0)
    meter.sample({me: "trainer"}, now=100.0, gpus={me: two})
    meter.sample({me: "trainer"}, now=130.0, gpus={me: two})
    meter.sample({me: "trainer"}, now=160.0, gpus={})  # released its GPUs in between: the last 30 s not counted
    hours = meter.device_hours()
    assert hours["trainer"][GPU] == pytest.approx(2 * 30 / 3600)
    assert hours["trainer"][CPU_CORE] == pytest.approx(process_cpu_seconds(me) / 3600, rel=0.05)
    meter.sample({2**22 + 7: "rollout"}, now=170.0, gpus={})  # no such process: nothing is counted
    assert "rollout" not in meter.device_hours()


@pytest.mark.integration
def test_memory_is_judged_from_the_first_reading_after_the_first_step_of_the_processes_up_then():
    # The child holds 64 MiB more once told to (a line on stdin): after settle, as a leak would.
    grow = 'import sys\nprint(1, flush=True)\nsys.stdin.readline()\nheld = b"x" * (64 << 20)\nprint(2, flush=True)\n'
    child = subprocess.Popen(
        [sys.executable, "-c", grow + "sys.stdin.readline()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "1\n"
        meter = UsageMeter()
        meter.sample({child.pid: "rollout"}, now=0.0, gpus={})
        assert meter.resource_trends() == []  # loading: nothing is judged before the first step
        meter.settle()
        settled = process_rss_gib(child.pid)
        assert [(t.settled_gib, t.last_gib) for t in meter.resource_trends()] == [(settled, settled)]
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "2\n"
        meter.sample({child.pid: "rollout"}, now=2.0, gpus={})
        meter.sample({os.getpid(): "reward"}, now=2.0, gpus={})  # first seen after the first step: a restart
        [trend] = meter.resource_trends()
        assert (trend.role, trend.pid) == ("rollout", child.pid)
        assert trend.settled_gib == pytest.approx(settled, abs=2 / 1024)
        assert trend.last_gib - trend.settled_gib == pytest.approx(64 / 1024, abs=4 / 1024)
    finally:
        child.kill()
        child.wait()


@pytest.mark.integration
def test_cpu_time_is_the_processes_own_and_a_sleeping_child_costs_nothing():
    # The child burns 0.4 s of CPU, then sleeps: its count must stop at what it burned, whatever the wall time.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\nprint(1, flush=True)\n"
    child = subprocess.Popen([sys.executable, "-c", burn + "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "1\n"
        meter = UsageMeter()
        meter.sample({child.pid: "reward"}, now=0.0, gpus={})
        time.sleep(1.0)  # a wall second of the child sleeping is what the count must leave out
        meter.sample({child.pid: "reward"}, now=1.0, gpus={})
        used = meter.device_hours()["reward"][CPU_CORE] * 3600
        assert 0.4 <= used < 0.4 + 0.35  # the burn plus the interpreter's start, not the second of sleep
    finally:
        child.kill()
        child.wait()


@pytest.mark.integration
def test_a_process_is_listed_with_the_processes_it_started():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "print(c.pid, flush=True)\ntime.sleep(30)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        grandchild = int(parent.stdout.readline())
        assert sorted(with_descendants(parent.pid)) == sorted([parent.pid, grandchild])
    finally:
        os.kill(grandchild, 9)
        parent.kill()
        parent.wait()
