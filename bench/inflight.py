"""What ``rollout.inflight_updates`` costs or gains: the demo's pipeline with and without in-flight weight updates.

    python -m bench.inflight [--model DIR] [--data DIR] [--steps 12] [--skip 3] [--repeats 2]
                             [--config YAML] [--set KEY=VALUE ...] [--chunks 32 2]

``rlpipe run`` of examples/arith-grpo.yaml (64 prompts x 8 completions, 6 new tokens, batch 64, asynchronous) with
the model and data named (default the demo's, ``make model``), the variants taking turns repeat by repeat so that
load from the rest of the machine hits them alike:

- **off**: the example as it is: each batch generated in one engine call on the version loaded before it;
- **on, chunk 32**: ``rollout.inflight_updates``: every chunk of up to 32 tokens (here the whole answer) on the
  newest version, two batches in hand sharing the engine's calls (``rollout.episode_batches``);
- **on, chunk 2**: the same, three calls per answer: new versions land inside samples.

Each run's steady steps/s and completions/s are over its steps after the first ``--skip``; the share of
completions that mixed versions (``mixed_version_fraction``), the mean staleness and the held-out accuracy after
the last step say what in flight changed. ``--config`` runs another example (``--model``/``--data`` then name its
model and data: the long tail is ``--config examples/long-tail.yaml --model models/tiny-long-tail --data
data/long-tail``, ``make model-long-tail``), ``--set`` puts settings over it (``rollout.backend=hf`` for the
transformers engine), ``--chunks`` names the chunk sizes tried. Writes build/bench/inflight.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from bench.deterministic import steady_steps_per_s
from bench.pipeline_run import demo_overrides, run_pipeline, steady_steps
from services.common.observe import metrics as m

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "bench"
CONFIG = ROOT / "examples" / "arith-grpo.yaml"


def variants(chunks: list[int]) -> dict[str, list[str]]:
    """Off, then in flight at each chunk size."""
    on = {
        f"on, chunk {chunk}": ["rollout.inflight_updates=true", f"rollout.inflight_chunk_tokens={chunk}"]
        for chunk in chunks
    }
    return {"off": [], **on}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-arith")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "arith", help="holds train.jsonl and eval.jsonl")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out (start-up)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting over the config")
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 2], help="inflight_chunk_tokens to try")
    args = parser.parse_args()
    runs = variants(args.chunks)
    if args.steps < args.skip + 3:
        parser.error(f"--steps must be at least --skip + 3 ({args.skip + 3})")
    if not (args.model / "config.json").is_file():
        parser.error(f"no model at {args.model} (make model, or --model build/test-model/model)")
    OUT.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    measured: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name, settings in runs.items():
            run_id = "bench-inflight-" + name.replace(", ", "-").replace(" ", "")
            run_dir = OUT / "runs" / run_id
            overrides = [*demo_overrides(run_dir, args.model, args.data, args.steps), *args.set, *settings]
            rows = run_pipeline(args.config, overrides, run_dir, args.steps)
            steps_per_s, completions_per_s = steady_steps_per_s(rows, args.skip)
            steady = steady_steps(rows, args.skip)
            measured[name].append(
                {
                    "steps_per_s": round(steps_per_s, 4),
                    "completions_per_s": round(completions_per_s, 1),
                    "mixed_version_fraction": round(statistics.fmean(r[m.MIXED_VERSION_FRACTION] for r in steady), 4),
                    "staleness_mean": round(statistics.fmean(r[m.STALENESS_MEAN] for r in steady), 3),
                    "eval_accuracy": [r[m.EVAL_ACCURACY] for r in rows if r.is_eval][-1],
                }
            )
            print(f"repeat {repeat + 1} {name}: {json.dumps(measured[name][-1])}", flush=True)
    machine = {"cpus": os.cpu_count(), "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}
    with (OUT / "inflight.jsonl").open("w") as out:
        for name, runs in measured.items():
            out.write(json.dumps({"variant": name, "runs": runs, "machine": machine}) + "\n")
    off = statistics.median(run["steps_per_s"] for run in measured["off"])
    print(f"{'variant':14} {'steps/s':>8} {'x off':>6} {'mixed':>6} {'staleness':>9} {'accuracy':>8}")
    for name, runs in measured.items():
        rate = statistics.median(run["steps_per_s"] for run in runs)
        mixed = statistics.median(run["mixed_version_fraction"] for run in runs)
        stale = statistics.median(run["staleness_mean"] for run in runs)
        accuracy = statistics.median(run["eval_accuracy"] for run in runs)
        print(f"{name:14} {rate:8.3f} {rate / off:6.2f} {mixed:6.3f} {stale:9.2f} {accuracy:8.3f}")
    print(f"machine: {json.dumps(machine)}; wrote {OUT / 'inflight.jsonl'}")


if __name__ == "__main__":
    main()
