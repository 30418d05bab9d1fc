"""rlpipe's data-plane throughput on this machine, stage by stage and end to end.

    python -m bench.throughput [--models tiny,smol] [--repeats 3] [--pipeline-steps 60] [--no-pipeline] [--sync]

For each model that is present (``tiny``: models/tiny-arith with examples/arith-grpo.yaml, ``make model``;
``smol``: models/smollm2-135m-instruct with examples/smol-arith.yaml, ``make model-smol``), at the
example's own batch shapes (prompts per rollout batch, group size, max new tokens, trainer batch):

- **rollout**: one batch of real training prompts through each engine of services/rollout/engines.py,
  transformers ``generate`` (``hf``, the baseline) and ``vllm``; generated tokens/s and completions/s;
- **learner**: ``Learner.step`` on the completions the rollout just generated (real lengths), with
  ``train.micro_batch_tokens`` off (the baseline) and on (``--micro-batch-tokens``); response
  tokens/s and completions/s;
- **pipeline** (tiny only; SmolLM2's steps take a minute each here): ``rlpipe run`` for
  ``--pipeline-steps`` steps, completions/s over its steady steps (read from the run's metrics.jsonl),
  the trainer's busy fraction (sum of ``step_time_s`` over the same wall time) and each process's CPU
  share, sampled from /proc, which names the stage that bounds the run. Its baseline is the slower of
  the stages alone (rollout vLLM, learner without micro-batches): the ratio says how near the
  pipeline gets to its bottleneck stage. Each step's wall interval split by phase (the trainer's
  ``time/<phase>_s``) and each role's busy/idle/blocked fractions come with it;
- **sync** (``--sync``, tiny only): the same run with ``train.synchronous`` (generate, score and train one
  batch at a time through the same services), run after the asynchronous one; prints async/sync.

Every process here and every rlpipe service runs one torch thread (``service.torch_threads``). The
variants of a measurement take turns repeat by repeat, so load from the rest of the machine hits them
alike; medians are reported. Writes ``build/bench/throughput.jsonl`` and ``build/bench/throughput.png``
and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from bench.pipeline_run import CpuSampler, run_pipeline, steady_steps, where_the_time_went
from services.common.config import RunConfig, load_config
from services.common.model.datasets import load_jsonl
from services.common.observe.metrics import COMPLETIONS, RESPONSE_LENGTH_MEAN, STEP_TIME_S, TIME
from services.common.transport.messages import ExperienceGroup, Prompt, RolloutGroup, ScoredGroup, advance

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "bench"


@dataclass(frozen=True)
class Model:
    name: str
    config: Path
    micro_batch_tokens: int  # the "on" variant's budget: a few micro-batches per step at the example's shapes

    @property
    def present(self) -> bool:
        cfg = yaml.safe_load(self.config.read_text())
        return (ROOT / cfg["model"]["path"] / "config.json").is_file()


MODELS = {
    "tiny": Model("tiny", ROOT / "examples" / "arith-grpo.yaml", micro_batch_tokens=1024),
    "smol": Model("smol", ROOT / "examples" / "smol-arith.yaml", micro_batch_tokens=1024),
}


@dataclass
class Measurement:
    """One variant of one measurement: its per-repeat seconds and the work each repeat did."""

    model: str
    kind: str  # rollout | learner | pipeline
    variant: str
    baseline: str  # the variant of the same kind this one is compared with
    seconds: list[float] = field(default_factory=list)
    tokens: int = 0  # per repeat: generated tokens (rollout), response tokens trained on (learner)
    completions: int = 0  # per repeat
    extra: dict = field(default_factory=dict)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median_s

    @property
    def completions_per_s(self) -> float:
        return self.completions / self.median_s

    def row(self) -> dict:
        return {
            **{k: v for k, v in asdict(self).items() if k != "extra"},
            "median_s": round(self.median_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "completions_per_s": round(self.completions_per_s, 1),
            **self.extra,
        }


def config_for(model: Model) -> RunConfig:
    data = yaml.safe_load(model.config.read_text())
    data["model"]["path"] = str(ROOT / data["model"]["path"])
    for key in ("train_path", "eval_path"):
        data["data"][key] = str(ROOT / data["data"][key])
    data["runs_dir"] = str(OUT / "runs")
    return load_config(None, **data)


def prompt_batch(cfg: RunConfig, tokenizer) -> tuple[list[dict], list[list[int]]]:
    """The first rollout batch of training rows, rendered and tokenized as the feeder and rollout do."""
    from services.common.model.chat import render_rows

    rows = render_rows(load_jsonl(cfg.data.train_path)[: cfg.rollout.prompts_per_batch], tokenizer)
    return rows, [tokenizer.encode(row["prompt"], add_special_tokens=False) for row in rows]


def alternate(variants: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each variant per repeat, the variants taking turns (one untimed warm-up call each first)."""
    for run in variants.values():
        run()
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def bench_rollout(model: Model, cfg: RunConfig, repeats: int) -> tuple[list[Measurement], list]:
    """Both engines on one batch of prompts; returns the measurements and the last vLLM generations with
    their rows and prompt ids (the learner trains on them)."""
    from services.rollout.engines import HfEngine, VllmEngine

    engines = {"hf": HfEngine(cfg), "vllm": VllmEngine(cfg)}
    rows, prompt_ids = prompt_batch(cfg, engines["hf"].tokenizer)
    last: dict[str, list] = {}

    def generate(name: str) -> Callable[[], None]:
        def run() -> None:
            last[name] = engines[name].generate(prompt_ids, cfg.sampling, cfg.train.max_seq_len)

        return run

    seconds = alternate({name: generate(name) for name in engines}, repeats)
    measurements = []
    for name, groups in last.items():
        generations = [g for group in groups for g in group]
        measurements.append(
            Measurement(
                model=model.name,
                kind="rollout",
                variant=name,
                baseline="hf",
                seconds=seconds[name],
                tokens=sum(len(g.token_ids) for g in generations),
                completions=len(generations),
            )
        )
    return measurements, [rows, prompt_ids, last["vllm"]]


def experience(cfg: RunConfig, rows: list[dict], prompt_ids: list[list[int]], groups: list) -> list[ExperienceGroup]:
    """The rollout's generations as trainer input: scored by the configured reward functions, with the
    sampler's logprobs standing in for the reference's (the learner's cost does not depend on their values)."""
    from services.common.model.reward_rules import REWARD_FUNCTIONS

    functions = [(REWARD_FUNCTIONS[name], weight) for name, weight in cfg.reward.functions.items()]
    out = []
    for row, ids, group in zip(rows, prompt_ids, groups, strict=True):
        completions = [g.completion() for g in group]
        rollout = advance(
            Prompt(group_id=row["id"], prompt_id=row["id"], prompt=row["prompt"], answer=row["answer"]),
            RolloutGroup,
            prompt_ids=np.asarray(ids, dtype=np.int32),
            policy_version=0,
            completions=completions,
        )
        rewards = [sum(w * fn(c.text, row["answer"], c.finish_reason) for fn, w in functions) for c in completions]
        scored = advance(rollout, ScoredGroup, rewards=np.asarray(rewards, dtype=np.float32))
        out.append(advance(scored, ExperienceGroup, ref_logprobs=[c.logprobs for c in completions]))
    return out


def bench_bus(cfg: RunConfig, groups: list[ExperienceGroup], repeats: int) -> dict[str, float]:
    """A rollout batch's trips over the bus, on a nats-server of its own, two ways: each message on its own (the
    stage publishes it, waiting for the ack, the next stage fetches, decodes, validates and acks it) and batched (a
    stage publishes its batch's outputs together, the next fetches the batch,
    decodes and validates each, and acks them together, as ``Stage`` does now). A group travels three hops (the
    rollout's RolloutGroup, the reward's ScoredGroup, the reference's ExperienceGroup, which the trainer reads from
    EXPERIENCE); the prompt it starts as is a few bytes. Seconds per group, median over ``repeats`` passes, the
    two ways taking turns."""
    import asyncio
    import socket
    import tempfile

    from services.common.transport.bus import Bus
    from services.common.transport.nats_server import nats_server_binary
    from services.common.transport.streams import EXPERIENCE, ROLLOUTS, SCORED

    def only(group: ExperienceGroup, kind: type[Prompt]) -> Prompt:
        return kind.model_validate({name: getattr(group, name) for name in kind.model_fields if name != "kind"})

    hops = ((ROLLOUTS, RolloutGroup), (SCORED, ScoredGroup))

    async def one_at_a_time(bus: Bus, queues: dict, reader, tag: str) -> None:
        for n, group in enumerate(groups):
            for edge, kind in hops:
                await bus.publish(edge, only(group, kind), msg_id=f"{tag}-{n}-{edge}")
                [msg] = await queues[edge].fetch(1, timeout=10)
                await bus.decode(msg, kind)
                await msg.ack_sync()
            await bus.publish(EXPERIENCE, group, msg_id=f"{tag}-{n}-experience")
            await bus.decode(await reader.next(timeout=10), ExperienceGroup)

    async def batched(bus: Bus, queues: dict, reader, tag: str) -> None:
        for edge, kind in hops:
            await asyncio.gather(
                *(bus.publish(edge, only(g, kind), msg_id=f"{tag}-{n}-{edge}") for n, g in enumerate(groups))
            )
            msgs = []
            while len(msgs) < len(groups):
                msgs += await queues[edge].fetch(len(groups) - len(msgs), timeout=10)
            for msg in msgs:
                await bus.decode(msg, kind)
            await asyncio.gather(*(msg.ack_sync() for msg in msgs))
        await asyncio.gather(
            *(bus.publish(EXPERIENCE, g, msg_id=f"{tag}-{n}-experience") for n, g in enumerate(groups))
        )
        for _ in groups:
            await bus.decode(await reader.next(timeout=10), ExperienceGroup)

    async def passes(url: str) -> dict[str, list[float]]:
        nats_cfg = cfg.nats.model_copy(update={"url": url, "claim_check_bytes": cfg.nats.max_message_bytes})
        bus = await Bus(cfg.model_copy(update={"run_id": "bench-bus", "nats": nats_cfg}), "trainer").connect()
        await bus.ensure_streams()
        queues = {edge: await bus.work_queue(edge) for edge, _ in hops}
        reader = bus.read_from(EXPERIENCE, 1)
        ways = {"one_at_a_time": one_at_a_time, "batched": batched}
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for repeat in range(repeats + 1):  # the first pass of each warms up
            for name, way in ways.items():
                started = time.perf_counter()
                await way(bus, queues, reader, f"{repeat}-{name}")
                if repeat:
                    seconds[name].append((time.perf_counter() - started) / len(groups))
        await bus.close()
        return seconds

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as store:
        server = subprocess.Popen(
            [nats_server_binary(), "-js", "-sd", store, "-a", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(1.0)  # the server's start: a few ms here
            seconds = asyncio.run(passes(f"nats://127.0.0.1:{port}"))
        finally:
            server.terminate()
            server.wait(timeout=10)
    return {
        "bus_s_per_group": statistics.median(seconds["batched"]),
        "bus_s_per_group_one_at_a_time": statistics.median(seconds["one_at_a_time"]),
        "batch_groups": len(groups),
        "group_size": len(groups[0].completions),
    }


def bus_overhead(bus: dict[str, float], rollout: list[Measurement], learner: list[Measurement]) -> dict[str, float]:
    """The bus's seconds per group against the group's compute: the vLLM rollout's and the whole-batch learner
    step's median seconds, each over the groups it handled (completions / group size)."""
    generate = next(m for m in rollout if m.variant == "vllm")
    train = next(m for m in learner if m.variant == "whole batch")
    compute = sum(m.median_s / (m.completions / bus["group_size"]) for m in (generate, train))
    return {**bus, "compute_s_per_group": compute, "bus_fraction_of_compute": bus["bus_s_per_group"] / compute}


def bench_learner(model: Model, cfg: RunConfig, groups: list[ExperienceGroup], repeats: int) -> list[Measurement]:
    """``Learner.step`` on one trainer batch (``train.batch_size`` groups, the rollout batch repeated to fill it),
    micro-batches by token budget off and on."""
    from services.trainer.learning.batch import Batch
    from services.trainer.learning.learner import Learner
    from services.trainer.learning.passes import micro_batches

    batch = [groups[i % len(groups)] for i in range(cfg.train.batch_size)]
    on = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_tokens": model.micro_batch_tokens})})
    learners = {"whole batch": Learner(cfg), f"micro_batch_tokens {model.micro_batch_tokens}": Learner(on)}

    def step(name: str) -> Callable[[], None]:
        def run() -> None:
            learners[name].step(batch, learners[name].steps_done)

        return run

    seconds = alternate({name: step(name) for name in learners}, repeats)
    tokens = sum(len(c.token_ids) for g in batch for c in g.completions)
    completions = sum(len(g.completions) for g in batch)
    micro = learners[f"micro_batch_tokens {model.micro_batch_tokens}"]
    passes = len(micro_batches(torch.arange(completions), Batch.of(batch).lengths, micro.cfg.train))
    return [
        Measurement(
            model=model.name,
            kind="learner",
            variant=name,
            baseline="whole batch",
            seconds=seconds[name],
            tokens=tokens,
            completions=completions,
            extra={"micro_batches": passes if learners[name] is micro else 1},
        )
        for name in learners
    ]


def bench_pipeline(model: Model, steps: int, skip: int, synchronous: bool = False) -> Measurement:
    """``rlpipe run`` of the example for ``steps`` steps; steady completions/s and where the CPU went."""
    run_id = f"bench-throughput-{model.name}{'-sync' if synchronous else ''}"
    run_dir = OUT / "runs" / run_id
    overrides = [f"run_id={run_id}", f"runs_dir={run_dir.parent}", f"train.total_steps={steps}"]
    overrides += [f"data.eval_every_steps={steps}", f"checkpoint.save_every_steps={steps}"]
    overrides += [f"train.synchronous={str(synchronous).lower()}"]
    (run_dir / "run.json").unlink(missing_ok=True)  # the sampler must not read a previous run's pids
    started = time.time()
    with CpuSampler(run_dir / "run.json") as sampler:
        rows = run_pipeline(model.config, overrides, run_dir, steps)
    wall = time.time() - started
    steady = steady_steps(rows, skip)
    span = steady[-1][TIME] - steady[0][TIME]
    completions = sum(row[COMPLETIONS] for row in steady[1:])
    tokens = sum(row[COMPLETIONS] * row[RESPONSE_LENGTH_MEAN] for row in steady[1:])
    trainer_busy = sum(row[STEP_TIME_S] for row in steady[1:]) / span
    return Measurement(
        model=model.name,
        kind="pipeline",
        variant="rlpipe run --sync" if synchronous else "rlpipe run",
        baseline="slowest stage alone",
        seconds=[span],
        tokens=round(tokens),
        completions=round(completions),
        extra={
            "steps_measured": len(steady) - 1,
            "wall_s_with_startup": round(wall, 1),
            "median_step_time_s": round(statistics.median(row[STEP_TIME_S] for row in steady), 4),
            "trainer_busy_fraction": round(trainer_busy, 3),
            "cpu_cores_per_process": sampler.shares(steady[0][TIME], steady[-1][TIME]),
            **where_the_time_went(steady),
        },
    )


def plot(measurements: list[Measurement], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{m.model} {m.kind}\n{m.variant}" for m in measurements]
    axes[0].barh(labels, [m.completions_per_s for m in measurements], color="tab:blue")
    axes[0].set(xlabel="completions/s (median)", title="completions/s")
    axes[1].barh(labels, [m.tokens_per_s for m in measurements], color="tab:orange")
    axes[1].set(xlabel="tokens/s (median)", title="generated / trained tokens/s")
    for ax in axes:
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def ratios(measurements: list[Measurement]) -> dict[int, float]:
    """Each measurement's completions/s over its baseline's (same model): index -> ratio."""
    out = {}
    for i, m in enumerate(measurements):
        if m.kind == "pipeline":
            stages = [
                other.completions_per_s
                for other in measurements
                if other.model == m.model
                and (other.kind, other.variant) in (("rollout", "vllm"), ("learner", "whole batch"))
            ]
            if stages:
                out[i] = m.completions_per_s / min(stages)
            continue
        base = next(o for o in measurements if (o.model, o.kind, o.variant) == (m.model, m.kind, m.baseline))
        out[i] = m.completions_per_s / base.completions_per_s
    return out


def async_sync_pairs(measurements: list[Measurement]) -> list[tuple[Measurement, Measurement]]:
    """(asynchronous, synchronous) pipeline measurements of the same model."""
    pipelines = {(m.model, m.variant): m for m in measurements if m.kind == "pipeline"}
    return [
        (pipelines[(model, "rlpipe run")], synchronous)
        for (model, variant), synchronous in pipelines.items()
        if variant == "rlpipe run --sync" and (model, "rlpipe run") in pipelines
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", default="tiny,smol", help="comma-separated: tiny, smol (absent ones skipped)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each rollout and learner variant")
    parser.add_argument("--pipeline-steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5, help="first pipeline steps left out (start-up)")
    parser.add_argument("--no-pipeline", action="store_true", help="stages alone only")
    parser.add_argument("--sync", action="store_true", help="also the synchronous baseline (train.synchronous)")
    args = parser.parse_args()
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; choose from {sorted(MODELS)}")
    if args.pipeline_steps < args.skip + 5:
        parser.error(f"--pipeline-steps must be at least --skip + 5 ({args.skip + 5})")
    torch.set_num_threads(1)  # as every rlpipe service (service.torch_threads)
    OUT.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    measurements: list[Measurement] = []
    bus_rows: list[dict] = []
    for name in args.models.split(","):
        model = MODELS[name]
        if not model.present:
            print(f"{name}: {model.config} names a model that is not built; skipped (make model / make model-smol)")
            continue
        cfg = config_for(model)
        rollout, (rows, prompt_ids, groups) = bench_rollout(model, cfg, args.repeats)
        measurements += rollout
        trained = experience(cfg, rows, prompt_ids, groups)
        learner = bench_learner(model, cfg, trained, args.repeats)
        measurements += learner
        bus_rows.append({"model": name, **bus_overhead(bench_bus(cfg, trained, args.repeats), rollout, learner)})
        if name == "tiny" and not args.no_pipeline:
            measurements.append(bench_pipeline(model, args.pipeline_steps, args.skip))
            if args.sync:
                measurements.append(bench_pipeline(model, args.pipeline_steps, args.skip, synchronous=True))
    machine = {"cpus": os.cpu_count(), "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
    ratio = ratios(measurements)
    with (OUT / "throughput.jsonl").open("w") as out:
        for i, m in enumerate(measurements):
            row = {**m.row(), "ratio_to_baseline": round(ratio[i], 3) if i in ratio else None, "machine": machine}
            out.write(json.dumps(row) + "\n")
        for row in bus_rows:
            out.write(json.dumps({"kind": "bus", **row, "machine": machine}) + "\n")
    plot(measurements, OUT / "throughput.png")
    print(f"{'model':6} {'kind':9} {'variant':26} {'median s':>9} {'tokens/s':>10} {'compl./s':>9} {'x baseline':>11}")
    for i, m in enumerate(measurements):
        shown = f"{ratio[i]:.2f}x {m.baseline}" if i in ratio else ""
        print(
            f"{m.model:6} {m.kind:9} {m.variant:26} {m.median_s:9.3f} {m.tokens_per_s:10.1f} "
            f"{m.completions_per_s:9.1f} {shown}"
        )
        if m.kind == "pipeline":
            print(f"{'':17}{json.dumps(m.extra)}")
    for row in bus_rows:
        print(
            f"{row['model']}: the bus costs {row['bus_s_per_group'] * 1000:.2f} ms per group over its three hops in "
            f"batches of {row['batch_groups']} ({row['bus_s_per_group_one_at_a_time'] * 1000:.2f} ms a message at a "
            f"time), {row['bus_fraction_of_compute']:.1%} of the group's compute "
            f"({row['compute_s_per_group'] * 1000:.2f} ms: vLLM rollout + learner step, per group)"
        )
    for asynchronous, synchronous in async_sync_pairs(measurements):
        print(
            f"{asynchronous.model}: async/sync {asynchronous.completions_per_s / synchronous.completions_per_s:.2f}x "
            f"steady completions/s ({asynchronous.completions_per_s:.1f} vs {synchronous.completions_per_s:.1f})"
        )
    print(f"machine: {json.dumps(machine)}; wrote {OUT / 'throughput.jsonl'} and {OUT / 'throughput.png'}")


if __name__ == "__main__":
    main()
