"""Held-out accuracy of runs side by side, against steps and wall time: does the tool matter (docs/agents.md).

    python -m bench.tool_curve runs/tool-arith runs/tool-arith-no-tool --out docs/images/tool-arith-curve.png

Reads each run's metrics.jsonl (its ``eval_accuracy`` rows; wall time counts from the run's first metrics row),
writes one PNG with two panels and prints each evaluation as a Markdown table row.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from services.common.observe import metrics as m
from services.common.observe.records import read_metrics


@dataclass(frozen=True)
class Evaluation:
    step: int
    minutes: float  # since the run's first metrics row
    accuracy: float
    tool_calls_mean: float | None


def evaluations(run_dir: Path) -> list[Evaluation]:
    """The run's held-out evaluations in order; ValueError when it has none."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no rows")
    start = min(row[m.TIME] for row in rows)
    found = [
        Evaluation(
            step=step,
            minutes=(row[m.TIME] - start) / 60,
            accuracy=accuracy,
            tool_calls_mean=row.get(m.EVAL_TOOL_CALLS),
        )
        for row in rows
        if (accuracy := row.get(m.EVAL_ACCURACY)) is not None and (step := row.step) is not None
    ]
    if not found:
        raise ValueError(f"{run_dir}/metrics.jsonl has no eval_accuracy row: was data.eval_every_steps 0?")
    return found


def plot(curves: dict[str, list[Evaluation]], out: Path) -> None:
    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for name, curve in curves.items():
        by_step.plot([e.step for e in curve], [e.accuracy for e in curve], marker="o", label=name)
        by_time.plot([e.minutes for e in curve], [e.accuracy for e in curve], marker="o", label=name)
    by_step.set_xlabel("step")
    by_time.set_xlabel("wall minutes since the first metrics row")
    by_step.set_ylabel("held-out accuracy (greedy episodes)")
    for axes in (by_step, by_time):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (runs/<run_id>)")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = parser.parse_args(argv)
    curves = {run.name: evaluations(run) for run in args.runs}
    plot(curves, args.out)
    print("| run | step | minutes | held-out accuracy | tool calls per episode |")
    print("|---|---|---|---|---|")
    for name, curve in curves.items():
        for e in curve:
            calls = "" if e.tool_calls_mean is None else f"{e.tool_calls_mean:.2f}"
            print(f"| {name} | {e.step} | {e.minutes:.1f} | {e.accuracy:.3f} | {calls} |")


if __name__ == "__main__":
    main()
