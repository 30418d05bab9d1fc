"""The checks of ``rlpipe verify`` that judge how the smoke run went, beyond whether it ran
(services/cli/verify/checklist.py).

Each is a pure function of the smoke run's step rows (``metrics.jsonl``: one row per step) and a few numbers (the
launcher's memory readings of every role's processes), so each is tested on crafted rows; ``verify`` feeds them.
The bounds are deliberately loose: a smoke run is a few steps at a tiny batch, so they catch what is broken (a loss
of 1e6, entropy blown up tenfold, memory doubling in three steps), not what is merely noisy.

- ``ranges``: the loss (and, with a critic, the value loss and mean value) finite and within bounds.
- ``first-step``: the first step's row came within a bound of the deployment's start (the operator's
  ``--first-step-max-s``), and the step's own update time is shown.
- ``jumps``: entropy, reward mean and KL to the reference never move between two steps by more than
  ``floor + rel * min(|before|, |after|)``, plus a multiple of the reward's spread for the reward (``JUMP_RULES``).
- ``resources``: the trainer's host memory (and GPU memory where the rows have it) did not grow past
  ``GROWTH_ALLOWED`` from the second step to the last (the first allocates the optimizer and warms caches), nor did
  the host or GPU memory of any process of any role (rollout, reward, reference: ``UsageMeter.resource_trends``,
  GPU memory as NVML counts it per process) from its first reading after the first step to its last; device memory
  kept some headroom, a GPU the trainer's rows show was busy at some step, and so was each role's GPU at some sample.
- ``remote-services``: every remote service the config names (``reward.http.url``, ``rollout.environment_url``)
  answered a TCP connect; ``probe_remote`` makes the connections, the check only reads the results.
"""

from __future__ import annotations

import itertools
import math
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

from services.cli.verify.check import Check
from services.common.config import RunConfig
from services.common.observe import metrics as m
from services.common.observe.metric_types import Metric
from services.common.observe.records import MetricsRow
from services.common.observe.usage import ResourceTrend

LOSS_BOUND = 1e3  # |policy loss| per token; a working update stays orders of magnitude below
VALUE_SLACK = 2.0  # |mean value| may reach this many times reward.max_abs_reward (a return of rewards and KL)
FIRST_STEP_MAX_S = 600.0  # default bound from the deployment's start to the first step row, seconds


@dataclass(frozen=True)
class JumpRule:
    """A change from ``a`` to ``b`` is abnormal beyond ``floor + rel * min(|a|, |b|) + spreads * spread``, where
    spread is the larger of the two steps' ``spread`` metric (0 without one): a ratio band for values away from 0,
    an absolute one near it, widened by the metric's own noise."""

    floor: float
    rel: float
    spread: Metric | None = None
    spreads: float = 0.0
    from_step_2: bool = False  # step 1's value is fixed by construction, so leaving it is no jump


JUMP_RULES = {
    m.ENTROPY: JumpRule(floor=0.5, rel=1.0),  # nats per token: more than doubling (or halving) at once
    # A batch's mean reward moves with its spread; one that flips with no spread (all 0, then all 1) is suspect.
    m.REWARD_MEAN: JumpRule(floor=0.5, rel=1.0, spread=m.REWARD_STD, spreads=3.0),
    # Nats per token. Step 1 trains on the reference's own samples, so its KL is 0 by construction and the move
    # away from it is judged by the level (the kl_too_high alert rule), not as a jump: the tiny model's live run went
    # 0 -> 6.3 at step 2. A tiny batch's KL swings widely after that (a smoke run went 2.9 -> 0.23), so only a leap
    # that leaves the reference far behind counts.
    m.KL_REF: JumpRule(floor=5.0, rel=4.0, from_step_2=True),
}
GROWTH_ALLOWED = (0.5, 0.25)  # (GiB, fraction): memory growth past both is taken as a leak
MIN_HEADROOM = 0.02  # fraction of device memory left free; below it the next longer batch runs out of memory
MEMORY_METRICS = (m.HOST_RSS_GB, m.CUDA_RESERVED_GB, m.GPU_MEM_USED_GB)


def ranges_check(rows: list[MetricsRow], max_abs_reward: float, with_critic: bool) -> Check:
    """The loss, and with a critic its value loss and mean value, finite and within bounds in every step row."""
    if not rows:
        return Check("ranges", "skip", "no step rows")
    value_bound = VALUE_SLACK * max_abs_reward
    bounds = {m.LOSS: LOSS_BOUND} | ({m.VALUE_LOSS: value_bound**2, m.VALUE_MEAN: value_bound} if with_critic else {})
    bad = []
    for metric, bound in bounds.items():
        for row in rows:
            value = row.get(metric)
            if value is None or not math.isfinite(value) or abs(value) > bound:
                bad.append(f"{metric.key} {value!r} at step {row.step} (allowed |x| <= {bound:g})")
    if bad:
        return Check("ranges", "fail", "; ".join(bad[:5]) + (f"; {len(bad) - 5} more" if len(bad) > 5 else ""))
    spans = ", ".join(
        f"{metric.key} {min(row[metric] for row in rows):.3g}..{max(row[metric] for row in rows):.3g}"
        for metric in bounds
    )
    return Check("ranges", "pass", f"{spans} over {len(rows)} steps")


def first_step_check(rows: list[MetricsRow], started_at: float, max_s: float) -> Check:
    """The first step row within ``max_s`` seconds of ``started_at`` (wall time the deployment was started)."""
    if not rows:
        return Check("first-step", "skip", "no step rows")
    first = rows[0]
    came = first.get(m.TIME)
    if came is None:
        return Check("first-step", "fail", f"step {first.step}'s row has no time")
    took = came - started_at
    update = first.get(m.STEP_TIME_S)
    detail = f"first step {took:.1f} s after the start (bound {max_s:g} s)" + (
        f", its update {update:.2f} s" if update is not None else ""
    )
    return Check("first-step", "pass" if took <= max_s else "fail", detail)


def abnormal_jumps(values: list[tuple[int, float, float]], rule: JumpRule) -> list[str]:
    """The step-to-step changes of ``values`` ((step, value, spread) in order) that break ``rule``."""
    found = []
    for (step_a, a, spread_a), (step_b, b, spread_b) in itertools.pairwise(values):
        allowed = rule.floor + rule.rel * min(abs(a), abs(b)) + rule.spreads * max(spread_a, spread_b)
        if abs(b - a) > allowed:
            found.append(f"{a:.4g} at step {step_a} -> {b:.4g} at step {step_b}")
    return found


def jumps_check(rows: list[MetricsRow]) -> Check:
    """No abnormal step-to-step jump in entropy, reward mean or KL to the reference (``JUMP_RULES``)."""
    if len(rows) < 2:
        return Check("jumps", "skip", f"{len(rows)} step row(s): no step-to-step change to judge")
    bad, seen = [], []
    for metric, rule in JUMP_RULES.items():
        series = []
        for row in rows:
            if rule.from_step_2 and row.step == 1:
                continue
            value, spread = row.finite(metric), (row.get(rule.spread) if rule.spread else None) or 0.0
            if value is not None:
                series.append((row.step, value, spread if math.isfinite(spread) else 0.0))
        bad += [f"{metric.key} {jump}" for jump in abnormal_jumps(series, rule)]
        seen.append(f"{metric.key} " + " -> ".join(f"{value:.3g}" for _, value, _ in series))
    if bad:
        return Check("jumps", "fail", "; ".join(bad))
    return Check("jumps", "pass", "; ".join(seen))


def leaked(before_gib: float, after_gib: float) -> bool:
    """Memory that grew past both of ``GROWTH_ALLOWED`` (GiB and fraction) once the first step was done."""
    grew = after_gib - before_gib
    return grew > GROWTH_ALLOWED[0] and grew > GROWTH_ALLOWED[1] * before_gib


def resources_check(rows: list[MetricsRow], processes: list[ResourceTrend] | None = None) -> Check:
    """Memory did not grow like a leak, in the trainer's rows or in any role's ``processes``, device memory kept
    headroom, and a GPU in the rows was used."""
    settled = rows[1:] if len(rows) > 2 else rows  # the first step allocates the optimizer and warms caches
    if not settled:
        return Check("resources", "skip", "no step rows")
    problems, evidence = [], []
    for metric in MEMORY_METRICS:
        series = [v for v in (row.get(metric) for row in settled) if v is not None]
        if len(series) < 2:
            continue
        evidence.append(f"{metric.key} {series[0]:.2f} -> {series[-1]:.2f} GiB")
        if leaked(series[0], series[-1]):
            grew = series[-1] - series[0]
            problems.append(
                f"{metric.key} grew {grew:.2f} GiB over {len(series)} steps ({series[0]:.2f} -> {series[-1]:.2f})"
            )
    by_role = itertools.groupby(sorted(processes or [], key=lambda t: (t.role, t.pid)), key=lambda t: t.role)
    for role, trends in ((role, list(trends)) for role, trends in by_role):
        role_evidence, role_problems = role_resources(role, trends)
        evidence += role_evidence
        problems += role_problems
    headroom = [v for v in (row.get(m.CUDA_HEADROOM) for row in rows) if v is not None]
    if headroom:
        evidence.append(f"least device headroom {min(headroom):.0%}")
        if min(headroom) < MIN_HEADROOM:
            problems.append(f"device memory headroom fell to {min(headroom):.1%} (below {MIN_HEADROOM:.0%})")
    utilisation = [v for v in (row.get(m.GPU_UTIL) for row in rows) if v is not None]
    if utilisation:
        evidence.append(f"GPU utilisation up to {max(utilisation):.0f}%")
        if max(utilisation) <= 0:
            problems.append("the GPU never ran a kernel during a step (gpu/util_pct 0 throughout)")
    if problems:
        return Check("resources", "fail", "; ".join(problems))
    if not evidence:
        return Check("resources", "skip", "the step rows carry no memory or GPU samples")
    return Check("resources", "pass", "; ".join(evidence))


def role_resources(role: str, trends: list[ResourceTrend]) -> tuple[list[str], list[str]]:
    """(evidence, problems) for one role's processes: host memory that grew like a leak and, where they hold GPUs,
    device memory that did, or GPUs that never ran a kernel after the first step."""
    before, after = sum(t.settled_gib for t in trends), sum(t.last_gib for t in trends)
    evidence = [f"{role} host RSS {before:.2f} -> {after:.2f} GiB"]
    problems = [
        f"{role} (pid {t.pid}) host RSS grew {t.last_gib - t.settled_gib:.2f} GiB after the first step "
        f"({t.settled_gib:.2f} -> {t.last_gib:.2f})"
        for t in trends
        if leaked(t.settled_gib, t.last_gib)
    ]
    on_gpu = [
        (t.pid, t.settled_gpu_gib, t.last_gpu_gib)
        for t in trends
        if t.settled_gpu_gib is not None and t.last_gpu_gib is not None
    ]
    if on_gpu:
        gpu_before, gpu_after = sum(before for _, before, _ in on_gpu), sum(after for _, _, after in on_gpu)
        evidence.append(f"{role} GPU memory {gpu_before:.2f} -> {gpu_after:.2f} GiB")
        problems += [
            f"{role} (pid {pid}) GPU memory grew {after - before:.2f} GiB after the first step "
            f"({before:.2f} -> {after:.2f})"
            for pid, before, after in on_gpu
            if leaked(before, after)
        ]
    peaks = [t.gpu_util_peak_pct for t in trends if t.gpu_util_peak_pct is not None]
    if peaks:
        evidence.append(f"{role} GPU utilisation up to {max(peaks):.0f}%")
        if max(peaks) <= 0:
            problems.append(f"{role}'s GPUs never ran a kernel after the first step (utilisation 0 at every sample)")
    return evidence, problems


def remote_services(cfg: RunConfig) -> dict[str, str]:
    """What remote services the config names: label -> URL."""
    named = {}
    if cfg.reward.http is not None:
        named["reward.http.url"] = cfg.reward.http.url
    if cfg.rollout.environment_url:
        named["rollout.environment_url"] = cfg.rollout.environment_url
    return named


def probe_remote(url: str, timeout_s: float = 5.0) -> str | None:
    """None when ``url``'s host accepts a TCP connection on its port, else why not."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout_s):
            return None
    except OSError as error:
        return f"{parsed.hostname}:{port}: {error}"


def remote_services_check(results: dict[str, tuple[str, str | None]]) -> Check:
    """``results``: label -> (URL, None when it answered, else why not)."""
    if not results:
        return Check("remote-services", "skip", "the config names no remote reward or environment service")
    down = [f"{label} ({url}): {why}" for label, (url, why) in results.items() if why is not None]
    if down:
        return Check("remote-services", "fail", "; ".join(down))
    return Check(
        "remote-services", "pass", ", ".join(f"{label} {url} reachable" for label, (url, _) in results.items())
    )
