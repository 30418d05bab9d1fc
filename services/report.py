"""Render a run's metrics.jsonl into a PNG of the curves an operator watches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (
    ("reward_mean", "reward mean (band: ±std)", "reward_std"),
    ("eval_accuracy", "held-out accuracy (greedy)", None),
    ("entropy", "policy entropy (nats/token)", None),
    ("kl_ref", "KL to reference (k3)", None),
    ("response_length_mean", "response length (tokens)", None),
    ("termination_rate", "termination rate (EOS)", None),
)


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def render_report(metrics_path: Path, out_path: Path) -> Path:
    rows = load_rows(metrics_path)
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, band) in zip(axes.flat, PANELS):
        points = [(r["step"], r[key], r.get(band) if band else None) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not points:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        steps, values, spread = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None, lw=1.5)
        if key.endswith("_rate") or key.endswith("accuracy"):
            ax.set_ylim(-0.02, 1.02)
        if band and all(s is not None for s in spread):
            ax.fill_between(steps, [v - s for v, s in zip(values, spread)], [v + s for v, s in zip(values, spread)], alpha=0.2)
    figure.suptitle(f"rlpipe run: {metrics_path.parent.name}")
    figure.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=100)
    plt.close(figure)
    return out_path
