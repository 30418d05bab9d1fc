"""Render a run's metrics and events into a PNG of the curves an operator watches, and an HTML page.

Inputs, both JSON lines in the run directory:

- ``metrics.jsonl``: rows with ``time`` (unix seconds) and usually ``step``; step rows
  carry ``reward_mean`` and the other training statistics, eval rows ``eval_accuracy``.
- ``events.jsonl`` (may be missing or empty): ``{"time", "step" (int or null), "kind",
  "message", ...}`` for config changes, alerts, rollbacks, resumes, restarts, pauses and stops.

Both roll into numbered parts past ``telemetry.jsonl_max_mib``; ``read_metrics`` and ``read_events``
(services/common/observe/records.py) read every part in order, typed by the metrics contract.

The x-axis is the trainer step everywhere. An event without a step is placed at the step
of the metrics row written nearest to it in time, and the HTML marks such steps with "≈".
After a rollback or resume the trainer writes some step numbers again; each curve is
broken where the step goes back instead of drawing a line back across the plot.
"""

from __future__ import annotations

import base64
import bisect
import html
import io
import json
import math
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.observe import metrics as m
from services.common.observe.events import Event
from services.common.observe.gpu_memory import KINDS as GPU_MEMORY_KINDS
from services.common.observe.gpu_memory import memory_lines, role_memory
from services.common.observe.metric_types import Metric
from services.common.observe.records import EventRecord, MetricsRow, read_events, read_metrics, step_rows
from services.common.observe.timeshare import StageActivity
from services.common.observe.usage import USAGE_FILE, RunCost

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.typing import LineStyleType

PANELS: tuple[tuple[Metric, str, Metric | None], ...] = (
    (m.REWARD_MEAN, "reward mean (band: ±std)", m.REWARD_STD),
    (m.EVAL_ACCURACY, "held-out accuracy (greedy)", None),
    (m.ENTROPY, "policy entropy (nats/token)", None),
    (m.KL_REF, "KL to reference (k3)", None),
    (m.RESPONSE_LENGTH_MEAN, "response length (tokens)", None),
    (m.TERMINATION_RATE, "termination rate (EOS)", None),
    (m.STEP_TIME_S, "wall time per step by phase (s); line: learner step", None),
)
# The trainer's split of the wall time between two step rows (services/trainer/service.py), stacked in the
# step-time panel; together they are the step's whole interval, of which step_time_s is the learner's part.
TIME_SPLIT = m.TIME_SPLIT.members()
# The step-row statistics whose recent means the HTML summary lists.
SUMMARY_METRICS = (
    m.REWARD_MEAN,
    m.REWARD_STD,
    m.ENTROPY,
    m.KL_REF,
    m.RESPONSE_LENGTH_MEAN,
    m.TERMINATION_RATE,
    m.STEP_TIME_S,
    m.TOKENS_PER_S,
    m.DYNAMIC_SAMPLING_DROPPED,
    m.AGENT_TURNS,
    m.AGENT_TOOL_CALLS,
    m.AGENT_TOOL_ERRORS,
    m.AGENT_ENV_SECONDS,
)
# The panels of multi-turn runs, drawn only when step rows carry agent/... keys
# (services/trainer/intake/episode_stats.py).
AGENT_PANELS = (
    (m.AGENT_TURNS, "turns per episode"),
    (m.AGENT_TOOL_CALLS, "tool calls per episode"),
    (m.AGENT_TOOL_ERRORS, "tool errors per episode"),
    (m.AGENT_ENV_SECONDS, "environment time per episode (s)"),
)
EVENT_STYLES: dict[str, tuple[str, LineStyleType]] = {
    Event.CONFIG_CHANGE: ("tab:blue", "--"),
    Event.ALERT: ("tab:red", "-"),
    Event.ROLLBACK: ("tab:purple", "-."),
    Event.RESUME: ("tab:green", ":"),
    Event.RESTART: ("tab:orange", ":"),
    Event.PAUSE: ("tab:gray", "--"),
    Event.UNPAUSE: ("tab:olive", "--"),
    Event.STOP: ("black", "-"),
}
OTHER_EVENT_STYLE: tuple[str, LineStyleType] = ("tab:brown", ":")


def event_steps(events: list[EventRecord], rows: list[MetricsRow]) -> list[tuple[int | None, bool]]:
    """For each event (step, estimated): its own step, or else the step of the metrics row
    nearest to it in time (estimated=True); (None, True) when no row has both time and step."""
    timeline = sorted((row.time, row.step) for row in rows if row.time is not None and row.step is not None)
    times = [t for t, _ in timeline]
    placed: list[tuple[int | None, bool]] = []
    for event in events:
        if event.step is not None:
            placed.append((event.step, False))
            continue
        at = event.time
        if not timeline or at is None or not math.isfinite(at):
            placed.append((None, True))
            continue
        i = bisect.bisect_left(times, at)
        when: float = at
        nearest = min((j for j in (i - 1, i) if 0 <= j < len(timeline)), key=lambda j: abs(times[j] - when))
        placed.append((timeline[nearest][1], True))
    return placed


def curve(
    rows: list[MetricsRow], metric: Metric, band: Metric | None
) -> tuple[list[float], list[float], list[float] | None]:
    """x, y and the ±band of one curve in file order, with a NaN gap wherever the step goes back."""
    xs: list[float] = []
    ys: list[float] = []
    spread: list[float] = []
    for row in rows:
        step, value = row.step, row.finite(metric)
        if step is None or value is None:
            continue
        if xs and step < xs[-1]:
            xs.append(math.nan)
            ys.append(math.nan)
            spread.append(math.nan)
        xs.append(step)
        ys.append(value)
        width = row.finite(band) if band is not None else None
        spread.append(math.nan if width is None else width)
    has_band = band is not None and any(math.isfinite(s) for s in spread)
    return xs, ys, spread if has_band else None


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display). Imported when a report is drawn, not with
    this module: the launcher and ``rlpipe verify`` import it at start and draw only at the end of a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(rows: list[MetricsRow], events: list[EventRecord], title: str) -> Figure:
    from matplotlib.lines import Line2D  # deferred with pyplot: see _pyplot

    figure, axes = _pyplot().subplots(2, 4, figsize=(20, 8))
    marks = [
        (step, event.kind or "?")
        for event, (step, _) in zip(events, event_steps(events, rows), strict=False)
        if step is not None and event.kind != Event.DONE  # the curves' own end; the events table lists it
    ]
    for ax, (metric, panel_title, band) in zip(axes.flat, PANELS, strict=False):
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        for step, kind in marks:
            color, style = EVENT_STYLES.get(kind, OTHER_EVENT_STYLE)
            ax.axvline(step, color=color, linestyle=style, lw=1, alpha=0.7)
        xs, ys, spread = curve(rows, metric, band)
        if metric == m.STEP_TIME_S:
            _stack_time_split(ax, rows)
        if not xs:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, lw=1.5)
        if metric.unit == "fraction":
            ax.set_ylim(-0.02, 1.02)
        if spread:
            ax.fill_between(
                xs,
                [y - s for y, s in zip(ys, spread, strict=False)],
                [y + s for y, s in zip(ys, spread, strict=False)],
                alpha=0.2,
            )
    # The eighth cell holds the legend of the event lines shared by every panel.
    legend_ax = axes.flat[len(PANELS)]
    legend_ax.axis("off")
    counts = Counter(kind for _, kind in marks)
    if counts:
        styles = [EVENT_STYLES.get(kind, OTHER_EVENT_STYLE) for kind in counts]
        handles = [Line2D([], [], color=color, linestyle=style) for color, style in styles]
        legend_ax.legend(handles, [f"{kind} ({n})" for kind, n in counts.items()], title="events", loc="center")
    else:
        legend_ax.text(0.5, 0.5, "no events", ha="center", va="center", transform=legend_ax.transAxes)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def _stack_time_split(ax: Any, rows: list[MetricsRow]) -> None:
    """The step's wall interval, stacked by phase, under the learner's own step-time line."""
    steps = [row for row in step_rows(rows) if all(row.finite(phase) is not None for phase in TIME_SPLIT)]
    if not steps:
        return
    xs = [row.step for row in steps]
    labels = [m.TIME_SPLIT.value(phase) for phase in TIME_SPLIT]
    ax.stackplot(xs, *[[row[phase] for row in steps] for phase in TIME_SPLIT], labels=labels, alpha=0.5)
    ax.legend(loc="upper right", fontsize="small")


def time_lines(rows: list[MetricsRow]) -> list[tuple[str, str]]:
    """(quantity, value) rows for the run summary and the report: the mean split of a step's wall interval by
    phase, and each role's busy/idle/blocked fractions as the last step row carries them."""
    steps = step_rows(rows)
    lines = []
    split = [row for row in steps if all(row.finite(phase) is not None for phase in TIME_SPLIT)]
    if split:
        means = {m.TIME_SPLIT.value(phase): sum(row[phase] for row in split) / len(split) for phase in TIME_SPLIT}
        wall = max(sum(means.values()), 1e-9)
        parts = ", ".join(f"{phase} {value:.3f} ({value / wall:.0%})" for phase, value in means.items())
        lines.append((f"wall s per step {wall:.3f}, by phase (mean of {len(split)} steps)", parts))
    shares: dict[str, dict[str, float]] = {}
    for (role, activity), value in (steps[-1].family(m.TIME_SHARE) if steps else {}).items():
        if math.isfinite(value):
            shares.setdefault(role, {})[activity] = value
    for role in sorted(shares):
        fractions = shares[role]
        known = [activity for activity in StageActivity if activity in fractions]
        lines.append((f"time share: {role}", ", ".join(f"{a} {fractions[a]:.0%}" for a in known)))
    return lines


def _png(rows: list[MetricsRow], events: list[EventRecord], title: str) -> bytes:
    figure = _figure(rows, events, title)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    _pyplot().close(figure)
    return buffer.getvalue()


def _agent_png(rows: list[MetricsRow]) -> bytes | None:
    """The agent panels (AGENT_PANELS and the share of each episode outcome), or None for a run without episodes."""
    seen = {parts for row in step_rows(rows) for parts in row.family(m.AGENT_OUTCOME)}
    outcomes = [m.AGENT_OUTCOME.of(*parts) for parts in sorted(seen)]
    if not outcomes:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(AGENT_PANELS) + 1, figsize=(5 * (len(AGENT_PANELS) + 1), 4))
    for ax, (metric, panel_title) in zip(axes, AGENT_PANELS, strict=False):
        ax.set_title(panel_title)
        xs, ys, _ = curve(rows, metric, None)
        ax.plot(xs, ys, lw=1.5)
    outcome_ax = axes[-1]
    outcome_ax.set_title("episode outcomes (share)")
    for outcome in outcomes:
        xs, ys, _ = curve(rows, outcome, None)
        outcome_ax.plot(xs, ys, lw=1.5, label=m.AGENT_OUTCOME.value(outcome))
    outcome_ax.set_ylim(-0.02, 1.02)
    outcome_ax.legend(loc="best")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()


def _memory_png(rows: list[MetricsRow]) -> bytes | None:
    """One panel per figure (allocated, reserved, used), a line per role; None for a run without GPU memory."""
    memory = role_memory(step_rows(rows))
    if not memory:
        return None
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(GPU_MEMORY_KINDS), figsize=(5 * len(GPU_MEMORY_KINDS), 4))
    for ax, kind in zip(axes, GPU_MEMORY_KINDS, strict=True):
        ax.set_title(f"GPU memory {kind} (GiB)")
        for role, figures in memory.items():
            if points := figures.get(kind):
                ax.plot([step for step, _ in points], [gib for _, gib in points], lw=1.5, label=role)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="best")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()


def render_report(metrics_path: Path, out_path: Path, events_path: Path | None = None) -> Path:
    """Write the curves of ``metrics_path`` with the events of ``events_path`` (default: the
    ``events.jsonl`` beside the metrics) marked on them to ``out_path`` as PNG."""
    events = read_events(events_path or metrics_path.with_name("events.jsonl"))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(_png(read_metrics(metrics_path), events, f"rlpipe run: {metrics_path.parent.name}"))
    return out_path


def _when(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return ""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _table(header: tuple[str, ...], body: list[tuple[Any, ...]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(cell))}</td>" for cell in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{lines}</tbody></table>"


def _image(png: bytes, alt: str) -> str:
    """A PNG embedded in the page, so the report is one self-contained file."""
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"


def summary(rows: list[MetricsRow]) -> list[tuple[str, Any]]:
    """(label, value) pairs: steps, wall time, first/final/best eval accuracy, and the means of
    SUMMARY_METRICS over the last 10% of step rows (at least one)."""
    steps = step_rows(rows)
    evals = [(row.step, accuracy) for row in rows if (accuracy := row.finite(m.EVAL_ACCURACY)) is not None]
    times = [row.time for row in rows if row.time is not None]
    items: list[tuple[str, Any]] = [
        ("step rows", len(steps)),
        ("last step", steps[-1].step if steps else None),
        ("wall time", str(timedelta(seconds=round(max(times) - min(times)))) if times else None),
    ]
    if evals:
        best = max(evals, key=lambda found: found[1])
        items += [
            (f"first eval accuracy (step {evals[0][0]})", evals[0][1]),
            (f"final eval accuracy (step {evals[-1][0]})", evals[-1][1]),
            (f"best eval accuracy (step {best[0]})", best[1]),
        ]
    tail = steps[-max(1, len(steps) // 10) :] if steps else []
    for metric in SUMMARY_METRICS:
        values = [value for row in tail if (value := row.finite(metric)) is not None]
        if values:
            items.append((f"{metric.key}, mean of the last {len(tail)} steps", sum(values) / len(values)))
    return items


def config_versions(rows: list[MetricsRow]) -> list[tuple[int, int | None, str, int]]:
    """(version, first step, first time, rows) for each ``config_version`` the rows carry, in order of appearance."""
    seen: dict[int, list[Any]] = {}
    for row in rows:
        version = row.get(m.CONFIG_VERSION)
        if not isinstance(version, int):
            continue
        if version not in seen:
            seen[version] = [row.step, _when(row.time), 0]
        seen[version][2] += 1
    return [(version, step, when, count) for version, (step, when, count) in seen.items()]


STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
img { max-width: 100%; }
"""


def run_cost_lines(run_dir: Path) -> list[tuple[str, str]]:
    """The device-hours and cost rows `rlpipe run` recorded in the run's usage.json (none before it wrote one)."""
    path = run_dir / USAGE_FILE
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    cost = RunCost(record["device_hours"], record["prices"], record["steps"], record["accuracy_gain"])
    return cost.lines()


def render_html(
    run_dir: Path, out: Path | None = None, *, metrics_path: Path | None = None, curves_png: bytes | None = None
) -> Path:
    """Write one self-contained HTML page for ``run_dir`` (default ``run_dir/report.html``): the
    curves as an embedded PNG, the summary, config versions (when rows carry them) and the events.

    ``metrics_path``: the run's metrics (default ``run_dir/metrics.jsonl``); ``curves_png``: the curves already
    drawn from them (drawing them is most of a report's CPU), else drawn here."""
    rows = read_metrics(metrics_path or run_dir / "metrics.jsonl")
    events = read_events(run_dir / "events.jsonl")
    name = run_dir.resolve().name
    curves = curves_png or _png(rows, events, f"rlpipe run: {name}")
    event_rows = [
        (
            _when(event.time),
            "" if step is None else f"≈{step}" if estimated else step,
            event.kind,
            event.message,
            ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in event.details.items()),
        )
        for event, (step, estimated) in zip(events, event_steps(events, rows), strict=False)
    ]
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>rlpipe report: {html.escape(name)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>rlpipe report: {html.escape(name)}</h1>",
        _image(curves, f"training curves of {name}"),
        "<h2>Summary</h2>",
        _table(("quantity", "value"), summary(rows)),
    ]
    agents = _agent_png(rows)
    if agents is not None:
        parts += ["<h2>Agents</h2>", _image(agents, f"multi-turn episodes of {name}")]
    memory = _memory_png(rows)
    if memory is not None:
        parts += [
            "<h2>GPU memory per role</h2>",
            _image(memory, f"GPU memory per role of {name}"),
            _table(("quantity", "value"), memory_lines(step_rows(rows))),
        ]
    timing = time_lines(rows)
    if timing:
        parts += ["<h2>Where the time goes</h2>", _table(("quantity", "value"), timing)]
    cost = run_cost_lines(run_dir)
    if cost:
        parts += ["<h2>Devices and cost</h2>", _table(("quantity", "value"), cost)]
    versions = config_versions(rows)
    if versions:
        parts += ["<h2>Config versions</h2>", _table(("version", "first step", "first seen", "rows"), versions)]
    parts += ["<h2>Events</h2>"]
    parts += [
        _table(("time", "step", "kind", "message", "details"), event_rows)
        if event_rows
        else "<p>No events recorded.</p>"
    ]
    parts += ["</body></html>"]
    out = out or run_dir / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts), encoding="utf-8")
    return out


def write_run_report(run_dir: Path, metrics_path: Path | None = None) -> tuple[Path, Path]:
    """``run_dir``'s report.png and report.html, the curves drawn once for both; ``metrics_path`` defaults to
    ``run_dir/metrics.jsonl``."""
    metrics_path = metrics_path or run_dir / "metrics.jsonl"
    png = render_report(metrics_path, run_dir / "report.png", run_dir / "events.jsonl")
    return png, render_html(run_dir, metrics_path=metrics_path, curves_png=png.read_bytes())
