"""The bench scripts' own logic, without running a bench: what they hand rlpipe and how they count."""

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from bench.pipeline_run import CpuSampler, where_the_time_went
from bench.throughput import (
    Measurement,
    async_sync_pairs,
    bench_bus,
    bus_overhead,
    ratios,
)
from bench.trl_worker import device_args, trl_rows
from bench.vs_trl import TASKS, Result, Task, rlpipe_config
from services.common.config import load_config
from services.common.observe.records import metrics_rows
from tests.support.messages import completion, experience_group
from tests.support.paths import ROOT
from tests.support.runs import run_config

pytestmark = pytest.mark.integration


def test_the_rlpipe_side_of_vs_trl_gets_the_same_task_as_trl(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model  # the bench's own defaults (models/tiny-arith) need `make model` first
    task = Task(
        model=str(model_dir),
        train_path=str(data_dir / "train.jsonl"),
        eval_path=str(data_dir / "eval.jsonl"),
        steps=12,
    )
    cfg = load_config(None, **rlpipe_config(task, tmp_path / "runs"))
    assert (cfg.train.total_steps, cfg.train.batch_size, cfg.rollout.prompts_per_batch) == (12, 64, 64)
    assert (cfg.sampling.group_size, cfg.sampling.max_new_tokens, cfg.sampling.temperature) == (8, 6, 1.0)
    assert (cfg.train.learning_rate, cfg.train.warmup_steps, cfg.train.max_grad_norm) == (1e-4, 10, 1.0)
    assert (cfg.train.clip.low, cfg.train.clip.high, cfg.train.kl.coef, cfg.train.kl.placement) == (
        0.2,
        0.2,
        0.001,
        "loss",
    )
    assert (cfg.train.loss_agg, cfg.train.algorithm, cfg.data.eval_every_steps) == ("token-mean", "grpo", 12)
    assert cfg.runs_dir == tmp_path / "runs"


def test_the_smol_task_hands_both_trainers_the_smol_example_settings_and_chat_prompts(tiny_model, tmp_path):
    model_dir, _ = tiny_model  # stands in for SmolLM2, which needs `make model-smol`
    chat = {"messages": [{"role": "system", "content": "Answer."}, {"role": "user", "content": "Tom has 2..."}]}
    train = tmp_path / "train.jsonl"
    train.write_text(
        json.dumps({**chat, "answer": "5", "id": "w1"}) + "\n" + json.dumps({"prompt": "2+3=", "answer": "5"})
    )
    task = replace(TASKS["smol"], model=str(model_dir), train_path=str(train), eval_path=str(train))

    cfg = load_config(None, **rlpipe_config(task, tmp_path / "runs"))
    assert (cfg.train.batch_size, cfg.rollout.prompts_per_batch, cfg.sampling.group_size) == (4, 4, 8)
    assert (cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.data.eval_size) == (40, 0.7, 150)
    assert (cfg.train.learning_rate, cfg.train.warmup_steps, cfg.train.total_steps) == (2e-5, 2, 12)
    assert cfg.reward.functions == {"final_number": 1.0}
    assert cfg.run_id == "bench-vs-trl-smol"
    # TRL gets a chat row as a conversational prompt (it applies the chat template), a plain row as text.
    assert trl_rows(task) == [{"prompt": chat["messages"], "answer": "5"}, {"prompt": "2+3=", "answer": "5"}]


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(TASKS))
def test_on_cuda_both_trainers_run_in_bf16_autocast_and_rlpipe_generates_with_transformers_as_trl_does(
    config_only_model, tmp_path, name
):
    model_dir, data_dir = config_only_model
    train = str(data_dir / "train.jsonl")
    task = replace(TASKS[name], model=str(model_dir), train_path=train, eval_path=train)

    on_cpu = load_config(None, **rlpipe_config(task, tmp_path / "runs"))
    on_gpu = load_config(None, **rlpipe_config(replace(task, device="cuda"), tmp_path / "runs"))

    assert (on_gpu.model.device, on_gpu.model.dtype, on_gpu.train.master_weights) == ("cuda", "bfloat16", "float32")
    assert on_gpu.rollout.backend == "hf"
    assert (on_cpu.model.device, on_cpu.rollout.backend) == ("auto", "vllm")  # the CPU bench as it was
    assert on_gpu.model_dump(exclude={"model", "train", "rollout"}) == on_cpu.model_dump(
        exclude={"model", "train", "rollout"}
    )
    assert device_args(task) == {"use_cpu": True, "bf16": False}
    assert device_args(replace(task, device="cuda")) == {"use_cpu": False, "bf16": True}


@pytest.mark.unit
def test_device_cuda_on_the_command_line_runs_the_smol_task_on_the_gpu_at_the_h200_runs_shape(
    config_only_model, tmp_path
):
    """--device cuda once reached neither trainer: the task kept its CPU device, so a GPU session would have run
    the CPU bench. It now sets the task's device, the issue's 16 prompts x 8 for 20 steps, and rollout replicas auto."""
    from bench.vs_trl import arguments, task_from

    task = task_from(arguments().parse_args(["--task", "smol", "--device", "cuda"]))
    assert (task.device, task.prompts_per_step, task.group_size, task.steps) == ("cuda", 16, 8, 20)
    assert device_args(task) == {"use_cpu": False, "bf16": True}
    model_dir, data_dir = config_only_model
    train = str(data_dir / "train.jsonl")
    cfg = load_config(
        None, **rlpipe_config(replace(task, model=str(model_dir), train_path=train, eval_path=train), tmp_path)
    )
    assert (cfg.model.device, cfg.rollout.replicas, cfg.train.batch_size, cfg.rollout.prompts_per_batch) == (
        "cuda",
        "auto",
        16,
        16,
    )
    cpu = task_from(arguments().parse_args(["--task", "smol", "--steps", "9", "--rollout-replicas", "2"]))
    assert (cpu.device, cpu.prompts_per_step, cpu.steps, cpu.rollout_replicas) == ("cpu", 4, 9, "2")


@pytest.mark.unit
def test_steady_figures_leave_out_the_skipped_steps():
    task = Task(steps=6, prompts_per_step=2, group_size=5)  # 10 completions a step
    # Steps 1-2 slow (start-up), then one step every 0.5 s.
    result = Result("x", 10.0, [4.0, 6.0, 6.5, 7.0, 7.5, 8.0], [0.0] * 6, 0.4, 0.5, "")
    assert result.steady_step_s(skip=2) == 0.5
    assert result.steady_completions_per_s(task, skip=2) == pytest.approx(3 * 10 / 1.5)
    summary = result.summary(task, skip=2)
    assert summary["completions_per_s_with_startup"] == 6.0  # 60 completions over the 10 s wall time
    assert summary["accuracy_gain_per_10k_completions"] == pytest.approx(0.1 / 60 * 10_000, abs=1e-3)


def test_each_variant_is_compared_with_its_baseline_and_the_pipeline_with_its_slowest_stage():
    def m(kind, variant, baseline, seconds):
        return Measurement("tiny", kind, variant, baseline, [seconds], tokens=100, completions=100)

    measurements = [
        m("rollout", "hf", "hf", 4.0),
        m("rollout", "vllm", "hf", 1.0),  # 100 completions/s
        m("learner", "whole batch", "whole batch", 2.0),  # 50/s: the slower stage
        m("learner", "micro", "whole batch", 4.0),
        m("pipeline", "rlpipe run", "slowest stage alone", 2.5),  # 40/s
    ]
    assert ratios(measurements) == {0: 1.0, 1: 4.0, 2: 1.0, 3: 0.5, 4: pytest.approx(0.8)}


@pytest.mark.unit
def test_the_sync_baseline_is_paired_with_the_async_run_of_its_model_and_the_time_split_is_averaged():
    def pipeline(variant, seconds):
        return Measurement("tiny", "pipeline", variant, "slowest stage alone", [seconds], completions=100)

    asynchronous, synchronous = pipeline("rlpipe run", 2.0), pipeline("rlpipe run --sync", 3.0)
    assert async_sync_pairs([synchronous, asynchronous]) == [(asynchronous, synchronous)]
    assert async_sync_pairs([synchronous]) == []
    steady = metrics_rows(
        [
            {"time/wait_s": 0.1, "time/compute_s": 0.5, "share/rollout/busy": 0.5},
            {"time/wait_s": 0.3, "time/compute_s": 0.7, "share/rollout/busy": 0.6, "share/rollout/idle": 0.4},
        ]
    )
    assert where_the_time_went(steady) == {
        "step_wall_s_by_phase": {"time/compute_s": 0.6, "time/wait_s": 0.2},
        "role_time_shares": {"rollout": {"busy": 0.6, "idle": 0.4}},
    }


@pytest.mark.unit
def test_the_cpu_sampler_reads_a_process_cpu_time_from_proc(tmp_path):
    run_json = tmp_path / "run.json"
    run_json.write_text(f'{{"pids": {{"me": {os.getpid()}}}}}')
    with CpuSampler(run_json, interval_s=0.02) as sampler:
        start, cpu_start = time.time(), time.process_time()
        while time.time() - start < 1.5:
            pass  # spin: this process is the one sampled
        end, cpu_end = time.time(), time.process_time()
    shares = sampler.shares(start, end)
    assert set(shares) == {"me"}
    # The share the process measured itself: however loaded the machine is, /proc must say the same, up to
    # clock ticks and the sampling interval at both ends.
    assert shares["me"] == pytest.approx((cpu_end - cpu_start) / (end - start), abs=0.1)


@pytest.mark.unit
def test_the_doc_section_is_added_once_then_replaced_in_place_leaving_the_rest(tmp_path):
    from bench.vs_trl import write_doc_section

    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\nkept above\n")
    write_doc_section(doc, "tiny", "first table")
    assert (
        doc.read_text() == "# Performance\n\nkept above\n\n<!-- vs_trl:tiny -->\nfirst table\n<!-- /vs_trl:tiny -->\n"
    )
    doc.write_text(doc.read_text() + "\nkept below\n")
    write_doc_section(doc, "tiny", "second table")
    write_doc_section(doc, "smol", "smol table")
    text = doc.read_text()
    assert text.count("<!-- vs_trl:tiny -->") == 1 and "first table" not in text
    assert "<!-- vs_trl:tiny -->\nsecond table\n<!-- /vs_trl:tiny -->\n\nkept below\n" in text
    assert text.endswith("<!-- vs_trl:smol -->\nsmol table\n<!-- /vs_trl:smol -->\n")


@pytest.mark.unit
def test_the_table_names_the_machine_every_run_and_the_ratios_against_trl_at_its_best():
    from bench.vs_trl import results_table

    rl = {"system": "rlpipe", "steps": 10, "completions_per_s": 600.0, "threads": "5 processes x 1 torch thread"}
    trl1 = {"system": "trl-t1", "steps": 10, "completions_per_s": 500.0, "threads": "1 process x 1 torch thread(s)"}
    trl2 = {"system": "trl-t2", "steps": 10, "completions_per_s": 700.0, "threads": "1 process x 2 torch thread(s)"}
    ratios = {
        "trl_threads": trl2["threads"],
        "completions_per_s": 0.857,
        "completions_per_s_with_startup": 0.7,
        "median_step_s": 1.1,
        "accuracy_gain_per_completion": 1.2,
    }
    machine = {
        "cpu_model": "Some CPU",
        "cpus": 2,
        "busy_before": 0.04,
        "busy": False,
        "load_before": 0.3,
        "load_after": 2.1,
    }
    table = results_table([rl, trl1, trl2], ratios, machine, "python -m bench.vs_trl --steps 10")
    assert "`python -m bench.vs_trl --steps 10`" in table and "Some CPU, 2 cores, 4% busy before the runs" in table
    assert "| completions_per_s | 600.0 | 500.0 | 700.0 |" in table
    assert "(1 process x 2 torch thread(s)): steady completions/s **0.857x**" in table
    assert "whole run including start-up **0.7x**" in table and "BUSY" not in table


@pytest.mark.unit
def test_the_busy_fraction_of_the_cpus_is_read_from_proc_stat_between_zero_and_one():
    from bench.pipeline_run import cpu_busy_fraction

    assert 0.0 <= cpu_busy_fraction(0.2) <= 1.0


@pytest.mark.parametrize("options", [[], ["--task", "smol", "--device", "cpu"]], ids=["defaults", "smol on the cpu"])
def test_the_bench_refuses_a_busy_machine_before_it_starts_anything(tmp_path, options):
    # --max-busy below zero: any machine is too busy; nothing may be built, run or written.
    done = subprocess.run(
        [sys.executable, "-m", "bench.vs_trl", *options, "--max-busy", "-1", "--load-probe-s", "0.2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "busy (over 0.2s, above --max-busy -100%)" in done.stderr and "or pass --allow-busy" in done.stderr


@pytest.mark.unit
def test_the_bus_overhead_is_taken_against_the_compute_of_one_group():
    rollout = [Measurement("tiny", "rollout", "vllm", "hf", [0.32], completions=64)]  # 8 groups of 8: 40 ms each
    learner = [Measurement("tiny", "learner", "whole batch", "whole batch", [0.8], completions=128)]  # 16: 50 ms
    overhead = bus_overhead({"bus_s_per_group": 0.0045, "group_size": 8}, rollout, learner)
    assert overhead["compute_s_per_group"] == pytest.approx(0.09)
    assert overhead["bus_fraction_of_compute"] == pytest.approx(0.05)


def test_a_batchs_three_hops_are_timed_through_a_real_broker_one_message_at_a_time_and_batched(tiny_model, tmp_path):
    cfg = run_config(tmp_path, tiny_model)
    completions = [completion()] * 2
    groups = [
        experience_group(f"g{n}", ref_logprobs=[c.logprobs for c in completions], completions=completions)
        for n in range(3)
    ]
    timed = bench_bus(cfg, groups, repeats=2)
    assert (timed["group_size"], timed["batch_groups"]) == (2, 3)
    assert 0 < timed["bus_s_per_group"] < 5 and 0 < timed["bus_s_per_group_one_at_a_time"] < 5


@pytest.mark.unit
def test_the_deterministic_bench_counts_the_steps_after_the_skipped_ones_over_their_own_wall_time():
    from bench.deterministic import steady_steps_per_s

    rows = [{"step": 0, "eval_accuracy": 0.1, "time": 0.0}]
    rows += [
        {"step": step, "reward_mean": 0.5, "completions": 8, "time": 10.0 + 2.0 * step} for step in range(6, 0, -1)
    ]
    # Steps 3..6 kept: three intervals of 2 s, the completions of the three steps that end them.
    assert steady_steps_per_s(metrics_rows(rows), skip=2) == (3 / 6.0, 24 / 6.0)
