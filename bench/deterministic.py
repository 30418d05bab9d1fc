"""What ``train.deterministic`` costs: the demo's pipeline with and without it, on this machine.

    python -m bench.deterministic [--model DIR] [--data DIR] [--steps 20] [--skip 4] [--repeats 2]

``rlpipe run`` of examples/arith-grpo.yaml (its shapes: 64 prompts x 8 completions, 6 new tokens, batch 64) with
the model and data named (default the demo's, ``make model``), three ways, taking turns repeat by repeat so that
load from the rest of the machine hits them alike:

- **asynchronous**: the example as it is (``max_inflight_batches: 2``);
- **synchronous**: ``train.synchronous``, which ``train.deterministic`` needs;
- **deterministic**: ``train.synchronous`` and ``train.deterministic``.

Each run's steady steps/s is its steps after the first ``--skip`` over their wall time (the metrics rows' ``time``);
the medians and the ratios deterministic/synchronous (what the setting itself costs) and deterministic/asynchronous
(what a reproducible run costs against the default) are printed. On a loaded machine the runs' rates follow the
load more than the setting, so the stages are also measured alone, in this process, each pair of variants taking
turns (``--repeats``): the rollout's vLLM generation of one batch unseeded (a request of n samples per prompt)
against seeded (a request per sample), the reference's scoring of that batch in one pass against a pass per group,
and ``Learner.step`` on one trainer batch without and with torch's deterministic algorithms, each in this process's
CPU seconds. ``--no-pipeline`` measures the stages only. Writes build/bench/deterministic.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.pipeline_run import demo_overrides, run_pipeline, steady_steps
from bench.throughput import experience, prompt_batch
from services.common.config import RunConfig, load_config_with
from services.common.observe import metrics as m
from services.common.observe.records import MetricsRow
from services.common.seeding import sampling_seed

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "bench"
CONFIG = ROOT / "examples" / "arith-grpo.yaml"
VARIANTS = {
    "asynchronous": [],
    "synchronous": ["train.synchronous=true"],
    "deterministic": ["train.synchronous=true", "train.deterministic=true"],
}


def steady_steps_per_s(rows: list[MetricsRow], skip: int) -> tuple[float, float]:
    """Steps/s and completions/s over the steps after the first ``skip`` (start-up and the first syncs)."""
    steps = steady_steps(rows, skip)
    span = steps[-1][m.TIME] - steps[0][m.TIME]
    return (len(steps) - 1) / span, sum(row[m.COMPLETIONS] for row in steps[1:]) / span


def stage_config(model: Path, data: Path) -> RunConfig:
    overrides = {
        "model.path": str(model),
        "data.train_path": str(data / "train.jsonl"),
        "data.eval_path": str(data / "eval.jsonl"),
        "runs_dir": str(OUT / "runs"),
    }
    return load_config_with(CONFIG, overrides)[0]


def alternate_cpu(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """This process's CPU seconds (every thread's) for each variant per repeat, the variants taking turns after one
    untimed call each. CPU seconds rather than wall: the other processes of a loaded machine do not enter them."""
    for run in variants.values():
        run()
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            started = time.process_time()
            run()
            seconds[name].append(time.process_time() - started)
    return seconds


def bench_stages(cfg: RunConfig, repeats: int) -> dict[str, dict[str, list[float]]]:
    """CPU seconds per repeat of each stage's two variants (see the module docstring), the variants taking turns."""
    from services.reference.service import ReferenceScorer
    from services.rollout.engines import VllmEngine
    from services.trainer.learning.learner import Learner

    engine = VllmEngine(cfg)
    rows, prompt_ids = prompt_batch(cfg, engine.tokenizer)
    n, length = cfg.sampling.group_size, cfg.train.max_seq_len
    seeds = [[sampling_seed(cfg.train.seed, f"e0-i{p}", i) for i in range(n)] for p in range(len(prompt_ids))]
    generated: list = []
    rollout = alternate_cpu(
        {
            "unseeded": lambda: generated.append(engine.generate(prompt_ids, cfg.sampling, length)),
            "seeded": lambda: engine.generate(prompt_ids, cfg.sampling, length, seeds),
        },
        repeats,
    )
    groups = experience(cfg, rows, prompt_ids, generated[-1])
    scorer = ReferenceScorer(cfg)

    def score(per_group: bool) -> None:
        scorer.per_group = per_group
        scorer(groups)

    reference = alternate_cpu({"one pass": lambda: score(False), "a pass per group": lambda: score(True)}, repeats)
    learner = Learner(cfg)
    batch = [groups[i % len(groups)] for i in range(cfg.train.batch_size)]

    def step(deterministic: bool) -> None:
        torch.use_deterministic_algorithms(deterministic)
        learner.step(batch, learner.steps_done)

    trainer = alternate_cpu({"default kernels": lambda: step(False), "deterministic": lambda: step(True)}, repeats)
    torch.use_deterministic_algorithms(False)
    return {"rollout": rollout, "reference": reference, "learner": trainer}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-arith")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "arith", help="holds train.jsonl and eval.jsonl")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=4, help="first steps left out (start-up)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-pipeline", action="store_true", help="the stages alone")
    args = parser.parse_args()
    if args.steps < args.skip + 3:
        parser.error(f"--steps must be at least --skip + 3 ({args.skip + 3})")
    if not (args.model / "config.json").is_file():
        parser.error(f"no model at {args.model} (make model, or --model build/test-model/model)")
    OUT.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)  # as every rlpipe service (service.torch_threads)
    stages = bench_stages(stage_config(args.model, args.data), max(args.repeats, 3))
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for repeat in range(0 if args.no_pipeline else args.repeats):
        for name, settings in VARIANTS.items():
            run_id = f"bench-deterministic-{name}"
            run_dir = OUT / "runs" / run_id
            overrides = [*demo_overrides(run_dir, args.model, args.data, args.steps), *settings]
            rows = run_pipeline(CONFIG, overrides, run_dir, args.steps)
            measured[name].append(steady_steps_per_s(rows, args.skip))
            print(f"repeat {repeat + 1} {name}: {measured[name][-1][0]:.3f} steps/s", flush=True)
    machine = {"cpus": os.cpu_count(), "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
    with (OUT / "deterministic.jsonl").open("w") as out:
        for stage, variants in stages.items():
            for name, seconds in variants.items():
                row = {"stage": stage, "variant": name, "cpu_seconds": [round(x, 4) for x in seconds]}
                out.write(json.dumps(row | {"machine": machine}) + "\n")
        for name, runs in measured.items():
            row = {"variant": name, "steps_per_s": [round(s, 4) for s, _ in runs], "machine": machine}
            out.write(json.dumps(row | {"completions_per_s": [round(c, 1) for _, c in runs]}) + "\n")
    print(f"{'stage':10} {'variant':18} {'CPU s':>9} {'x first':>8}")
    for stage, variants in stages.items():
        first = statistics.median(next(iter(variants.values())))
        for name, seconds in variants.items():
            print(f"{stage:10} {name:18} {statistics.median(seconds):9.4f} {statistics.median(seconds) / first:8.2f}")
    if measured["deterministic"]:
        medians = {
            name: (statistics.median(s for s, _ in runs), statistics.median(c for _, c in runs))
            for name, runs in measured.items()
        }
        print(f"{'variant':14} {'steps/s':>8} {'completions/s':>14}")
        for name, (steps_per_s, completions_per_s) in medians.items():
            print(f"{name:14} {steps_per_s:8.3f} {completions_per_s:14.1f}")
        deterministic = medians["deterministic"][0]
        print(
            f"deterministic/synchronous {deterministic / medians['synchronous'][0]:.2f}x, "
            f"deterministic/asynchronous {deterministic / medians['asynchronous'][0]:.2f}x steps/s"
        )
    print(f"machine: {json.dumps(machine)}; wrote {OUT / 'deterministic.jsonl'}")


if __name__ == "__main__":
    main()
