"""A short ``rlpipe run`` with its roles forked warm (``service.warm_start``) against each started cold.

    python -m bench.warm_start [--config examples/arith-grpo.yaml] [--steps 5] [--runs 2]

Runs the config for ``--steps`` steps, alternating cold and warm starts, each in a fresh run folder. Prints, per
run: the seconds from the launch to the trainer's first step (``startup.jsonl``), the run's wall time, and the CPU
seconds of the launcher and every process under it (``getrusage(RUSAGE_CHILDREN)``), then the warm/cold ratios of
the medians. Needs `make model` (the example's tiny model). Compare runs on a quiet machine: the load is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(config: Path, steps: int, warm: bool, runs_dir: Path) -> dict[str, float]:
    run_id = f"{'warm' if warm else 'cold'}-{time.monotonic_ns()}"
    overrides = [
        f"train.total_steps={steps}",
        f"service.warm_start={str(warm).lower()}",
        f"runs_dir={runs_dir}",
        f"run_id={run_id}",
        "data.eval_every_steps=0",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(config), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"rlpipe run exited with {done.returncode}:\n{done.stderr[-3000:]}")
    startup = [json.loads(line) for line in (runs_dir / run_id / "startup.jsonl").read_text().splitlines()]
    first_step = next(row["ready_after_s"] for row in startup if row["component"] == "first step")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"first_step_s": first_step, "wall_s": wall, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "arith-grpo.yaml")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=2, help="runs of each variant, alternating")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores")
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-warm-") as folder:
        for _ in range(args.runs):
            for warm in (False, True):
                row = one(args.config, args.steps, warm, Path(folder))
                results[warm].append(row)
                print(
                    f"{'warm' if warm else 'cold'}: first step {row['first_step_s']:.1f} s after the launch, "
                    f"run {row['wall_s']:.1f} s, {row['cpu_s']:.1f} CPU s",
                    flush=True,
                )
    for key in ("first_step_s", "wall_s", "cpu_s"):
        cold = statistics.median(r[key] for r in results[False])
        warm = statistics.median(r[key] for r in results[True])
        print(f"median {key}: cold {cold:.1f}, warm {warm:.1f}, warm/cold {warm / cold:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
