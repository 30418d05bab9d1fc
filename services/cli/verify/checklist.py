"""``rlpipe verify`` and ``rlpipe run --smoke``: the operations guide's post-deployment checklist as commands.

``rlpipe verify`` starts the deployment as ``rlpipe run`` does, for a smoke run of a few
steps at a small batch under its own run id (``<run_id>-smoke``, so the deployment's own run
is never touched; services/cli/verify/smoke.py), and checks, in order:

1. ``roles``: every service started and is reachable and healthy (gRPC health SERVING, its
   metrics endpoint answers, the trainer's status shows each one up), none died, and the trainer stopped
   cleanly (its final save; a stage that outlived its stop grace is noted, not failed).
2. ``weight-sync``: a trained policy version reached every rollout (its
   ``rlpipe_rollout_policy_version``), and on the steps that trained on groups of the
   trainer's current version the sampler's logprobs match the trainer's (the step's
   ``approx_kl``, the mean per-token difference, within ``LOGPROB_TOLERANCE``).
3. ``smoke-run``: sampling, reward and reference each processed groups (every replica's
   ``rlpipe_groups_processed_total{outcome="ok"}``) and the update logged every step.
4. ``checkpoint``: the run's final checkpoint was written, reads back whole (manifest and
   hashes) and its weights load into the model, on the store and on its mirror.
5. ``alert-drill``: a synthetic firing of every rule reaches every configured sink.
6. ``metrics``: entropy, reward mean and std, KL, response length and termination rate are
   in every step row, as finite numbers.
7. ``first-step``, ``ranges``, ``jumps``, ``resources``, ``remote-services``: how the steps went (the first
   one's time, the loss and value ranges, no abnormal jumps, memory and GPU stability) and whether the remote
   reward and environment services answer; pure functions of the step rows in services/cli/verify/health.py.
8. ``tuning``: one trial of a one-parameter study over the smoke config, run, scored and recorded as
   ``rlpipe tune`` does (services/cli/verify/tuning.py).

Against a running deployment (``rlpipe --address ADMIN verify``, ``verify_live``) nothing is started:
the roles and rollout versions come from the trainer's status, the rest from the run's own files and
stores, and the smoke run and the tuning trial are skipped.

A check whose evidence never came (the deployment did not start) is ``skip``. The record,
``verify.json`` (with the build and library versions, the redacted config, the first metrics and the
conclusion: services/cli/verify/record.py) and a short ``verify.md``, goes into the smoke run's directory; the exit code
is 1 when any check failed, and each failed check is named.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.cli.healthcheck import check as health_check
from services.cli.verify.alert_drill import run_drill
from services.cli.verify.check import Check
from services.cli.verify.checkpoints import verify_checkpoints
from services.cli.verify.compare import keep_previous
from services.cli.verify.health import (
    FIRST_STEP_MAX_S,
    first_step_check,
    jumps_check,
    probe_remote,
    ranges_check,
    remote_services,
    remote_services_check,
    resources_check,
)
from services.cli.verify.record import record_extras
from services.cli.verify.smoke import PROBE_TIMEOUT_S, STAGE_OF_ROLE, SmokeRun, smoke, trainer_status
from services.cli.verify.tuning import tuning_check
from services.common.config import RunConfig, load_config_with
from services.common.observe import metrics as m
from services.common.observe.records import MetricsRow, read_metrics
from services.common.observe.usage import ResourceTrend
from services.common.pb import admin_pb2
from services.common.transport.nats_connect import STAGE_ROLES
from services.trainer.intake.samples import SampleArchive

# Mean per-token |log pi_sampler - log pi_trainer| allowed on groups the trainer's current version generated:
# the same weights in two engines differ by rounding (~1e-4 in float32), a missed or torn sync by far more.
LOGPROB_TOLERANCE = 0.02
CURVES = (m.ENTROPY, m.REWARD_MEAN, m.REWARD_STD, m.KL_REF, m.RESPONSE_LENGTH_MEAN, m.TERMINATION_RATE)

# -- the checks ---------------------------------------------------------------------------------


def step_rows(cfg: RunConfig) -> list[MetricsRow]:
    return [row for row in read_metrics(cfg.metrics_file) if row.is_step]


def roles_check(run: SmokeRun) -> Check:
    if not run.started or (run.error and not run.finished):
        return Check("roles", "fail", run.error or "the deployment did not start")
    if run.role_problems:
        return Check("roles", "fail", "; ".join(run.role_problems))
    if "trainer" in run.failed_services:  # its stop is its final save
        return Check("roles", "fail", "the trainer did not stop cleanly (exit code or SIGKILL after its grace)")
    # A stateless stage that outlived its stop grace lost nothing (its work is redelivered); it is on the
    # record, not a failed role, since how long a loaded machine takes to tear an engine down says nothing of health.
    stragglers = [name for name in run.failed_services if name != "trainer"]
    note = f"; at stop {', '.join(stragglers)} did not exit cleanly within the grace" if stragglers else ""
    return Check("roles", "pass", run.role_evidence + note)


def weight_sync_check(run: SmokeRun, rows: list[MetricsRow]) -> Check:
    if not run.finished:
        return Check("weight-sync", "skip", "the smoke run did not finish")
    rollouts = {name: s for name, s in run.scraped.items() if s.role == "rollout"}
    behind = [
        f"{name} ({s.error or f'version {s.policy_version}'})" for name, s in rollouts.items() if not s.policy_version
    ]
    if not rollouts or behind:
        return Check("weight-sync", "fail", f"no trained policy version reached {', '.join(behind) or 'any rollout'}")
    versions = ", ".join(f"{name} at version {int(s.policy_version or 0)}" for name, s in rollouts.items())
    return logprobs_match(rows, versions)


def logprobs_match(rows: list[MetricsRow], versions: str) -> Check:
    """The weight-sync check once every rollout has a trained version (``versions`` says which): the sampler's
    logprobs against the trainer's on the steps that trained on groups of the trainer's current version."""
    fresh = [row for row in rows if row.get(m.STALENESS_MAX) == 0 and m.APPROX_KL in row]
    if not fresh:
        return Check("weight-sync", "fail", "no step trained on groups of the trainer's current version to compare")
    apart = [row for row in fresh if not abs(row[m.APPROX_KL]) <= LOGPROB_TOLERANCE]
    compared = ", ".join(f"step {row.step}: {row[m.APPROX_KL]:.2e}" for row in fresh[-5:])
    if apart:
        return Check(
            "weight-sync", "fail", f"sampler and trainer logprobs differ beyond {LOGPROB_TOLERANCE}: {compared}"
        )
    return Check("weight-sync", "pass", f"{versions}; logprob gap (approx_kl) {compared}")


def smoke_check(run: SmokeRun, rows: list[MetricsRow]) -> Check:
    if not run.finished:
        return Check("smoke-run", "skip" if not run.started else "fail", run.error or "the smoke run did not finish")
    missing, evidence = [], []
    for role, stage in STAGE_OF_ROLE.items():
        replicas = {name: s for name, s in run.scraped.items() if s.role == role}
        idle = [name for name, s in replicas.items() if s.groups_ok < 1]
        if not replicas or idle:
            missing.append(f"{stage} ({', '.join(idle) or 'no replica'} processed no group)")
        else:
            evidence.append(f"{stage} {sum(s.groups_ok for s in replicas.values()):g} groups")
    total = run.cfg.train.total_steps
    if len(rows) != total:
        missing.append(f"update ({len(rows)} of {total} steps logged)")
    else:
        evidence.append(f"update {total} steps")
    archived = SampleArchive(run.cfg.run_dir / "samples", run.cfg.telemetry.samples_keep_steps).steps()
    if missing:
        return Check("smoke-run", "fail", "no batch from " + "; ".join(missing))
    return Check("smoke-run", "pass", ", ".join(evidence) + f"; samples of steps {archived}")


def checkpoint_check(run: SmokeRun) -> Check:
    if not run.finished:
        return Check("checkpoint", "skip", "the smoke run did not finish")
    return stored_checkpoint_check(run.cfg)


def stored_checkpoint_check(cfg: RunConfig) -> Check:
    """The newest checkpoint on the store and the mirror reads back whole and loads into the model."""
    results = verify_checkpoints(cfg)
    bad = [f"{r.store}: {r.detail}" for r in results if not r.ok]
    if bad:
        return Check("checkpoint", "fail", "; ".join(bad))
    return Check("checkpoint", "pass", "; ".join(f"{r.store}: {r.detail}" for r in results))


def drill_check(cfg: RunConfig) -> Check:
    sinks = run_drill(cfg, list(cfg.alerts.rules))
    failed = [f"{s.sink}: {s.detail}" for s in sinks if not s.ok]
    if failed:
        return Check("alert-drill", "fail", "; ".join(failed))
    return Check("alert-drill", "pass", "; ".join(f"{s.sink}: {s.detail}" for s in sinks))


def metrics_check(run: SmokeRun, rows: list[MetricsRow]) -> Check:
    if not rows and not run.started:
        return Check("metrics", "skip", f"no step rows in {run.cfg.metrics_file}")
    return metrics_of(run.cfg, rows)


def metrics_of(cfg: RunConfig, rows: list[MetricsRow]) -> Check:
    """The training curves the guide asks for, in every step row, finite."""
    if not rows:
        return Check("metrics", "fail", f"no step rows in {cfg.metrics_file}")
    empty = [metric.key for metric in CURVES if not all(row.finite(metric) is not None for row in rows)]
    if empty:
        return Check("metrics", "fail", f"missing or not finite in some of {len(rows)} step rows: {', '.join(empty)}")
    last = rows[-1]
    shown = ", ".join(f"{metric.key} {last[metric]:.4g}" for metric in CURVES)
    return Check("metrics", "pass", f"{shown} (step {last.step})")


# -- the record ---------------------------------------------------------------------------------


def write_record(
    cfg: RunConfig,
    config_path: Path,
    checks: list[Check],
    took_s: float,
    settings: Mapping[str, Any] | None = None,
    rows: list[MetricsRow] | None = None,
) -> tuple[Path, Path]:
    """``verify.json`` (the checks, and ``verify_record.record_extras``: versions, config, first metrics, conclusion)
    and ``verify.md``; ``rows`` are the step rows the checks judged."""
    failed = [c.name for c in checks if c.status == "fail"]
    extras = record_extras(cfg, rows or [], checks)
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": str(config_path),
        "overrides": dict(settings or {}),
        "run_id": cfg.run_id,
        "passed": not failed,
        "failed": failed,
        "took_s": round(took_s, 1),
        "checks": [asdict(c) for c in checks],
        **extras,
    }
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    as_json, as_md = cfg.run_dir / "verify.json", cfg.run_dir / "verify.md"
    keep_previous(as_json)  # the record this one replaces stays the baseline `--against` compares with
    as_json.write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"# Verification of {config_path}",
        "",
        *([f"Overrides: `{' '.join(f'{k}={v}' for k, v in settings.items())}`", ""] if settings else []),
        f"{record['time']}, smoke run `{cfg.run_id}`, {record['took_s']} s: "
        + ("**passed**" if not failed else f"**failed**: {', '.join(failed)}"),
        "",
        f"Conclusion: {extras['conclusion']}. Build {extras['build']['version']} ({extras['build']['revision']}); "
        + ", ".join(f"{name} {version}" for name, version in extras["libraries"].items()),
        "",
        "| check | result | evidence |",
        "|---|---|---|",
        *(f"| {c.name} | {c.status} | {c.detail.replace('|', '/')} |" for c in checks),
    ]
    as_md.write_text("\n".join(lines) + "\n")
    return as_json, as_md


def run_health_checks(
    cfg: RunConfig, rows: list[MetricsRow], processes: list[ResourceTrend] | None = None
) -> list[Check]:
    """How the steps went (services/cli/verify/health.py): ranges, jumps, resources (the trainer's rows, and every
    role's ``processes`` where this machine launched them); then the remote services."""
    probed = {label: (url, probe_remote(url)) for label, url in remote_services(cfg).items()}
    return [
        ranges_check(rows, cfg.reward.max_abs_reward, with_critic=cfg.train.algorithm == "ppo"),
        jumps_check(rows),
        resources_check(rows, processes),
        remote_services_check(probed),
    ]


def verify(
    config_path: Path, settings: Mapping[str, Any] | None = None, first_step_max_s: float = FIRST_STEP_MAX_S
) -> tuple[list[Check], RunConfig, tuple[Path, Path]]:
    """Run the checklist against the embedded deployment, the config file with ``settings`` (dotted overrides)
    over it; raises ConfigError for a config that cannot start. The first step row must come within
    ``first_step_max_s`` of the start."""
    started, started_at = time.monotonic(), time.time()
    with tempfile.TemporaryDirectory(prefix="rlpipe-verify-") as folder:
        run = smoke(config_path, Path(folder), settings)
        rows = step_rows(run.cfg)
        checks = [
            roles_check(run),
            weight_sync_check(run, rows),
            smoke_check(run, rows),
            checkpoint_check(run),
            drill_check(run.cfg),
            metrics_check(run, rows),
            first_step_check(rows, started_at, first_step_max_s),
            *run_health_checks(run.cfg, rows, run.resources),
            # After the smoke run, whose deployment is stopped by now: a trial is a run of its own.
            tuning_check(run.config_path, run.cfg, Path(folder))
            if run.finished
            else Check("tuning", "skip", "the smoke run did not finish"),
        ]
    took_s = time.monotonic() - started
    return checks, run.cfg, write_record(run.cfg, config_path, checks, took_s, settings, rows)


def smoke_only(config_path: Path) -> list[Check]:
    """``rlpipe run --smoke``: the smoke run with its role and stage checks."""
    with tempfile.TemporaryDirectory(prefix="rlpipe-smoke-") as folder:
        run = smoke(config_path, Path(folder))
    return [roles_check(run), smoke_check(run, step_rows(run.cfg))]


def live_roles_check(services: Sequence[admin_pb2.ServiceStatus], probe: Callable[[str], str | None]) -> Check:
    """The roles check of a live deployment, from the trainer's status: every replica up or stopped in order (a
    scale-in is not a problem), every stage role with a replica up, and each one up answering its gRPC health
    (``probe(address)``: None when SERVING, else why not). A stopped replica is neither up nor probed."""
    down = [s for s in services if not s.up and not s.stopped]
    problems = [f"{s.instance}: down in the trainer's status" for s in down]
    named = {s.role for s in services if s.up} | {s.role for s in down}
    problems += [f"{role}: no replica up in the trainer's status" for role in STAGE_ROLES if role not in named]
    for service in services:
        if service.up and service.grpc_address and (reason := probe(service.grpc_address)):
            problems.append(f"{service.instance}: health {reason}")
    if problems:
        return Check("roles", "fail", "; ".join(problems))
    up = [s.instance for s in services if s.up]
    return Check("roles", "pass", f"{', '.join(up)}: up in the trainer's status, gRPC health SERVING")


def verify_live(
    config_path: Path, address: str, token: str, tls_ca: Path | None = None, settings: Mapping[str, Any] | None = None
) -> tuple[list[Check], RunConfig, tuple[Path, Path]]:
    """The checklist against a running deployment, through its trainer's Admin API at ``address``.

    Nothing is started or stopped: the roles and the versions their rollouts hold come from the trainer's
    status (and each replica's gRPC health where it is reachable from here), the logprob comparison and
    the curves from the run's metrics file when this machine sees it. The smoke run is skipped: it needs
    a deployment of its own (``rlpipe verify`` or ``rlpipe run --smoke`` on the same config). ``settings``
    (dotted overrides) apply over the file, as the deployment was launched with them."""
    started = time.monotonic()
    cfg, _ = load_config_with(config_path, settings or {})
    rows = step_rows(cfg) if cfg.metrics_file.is_file() else []
    status = trainer_status(address, token, tls_ca)
    if isinstance(status, str):
        roles = Check("roles", "fail", f"trainer admin: {status}")
        sync = Check("weight-sync", "skip", "the trainer's status could not be read")
    else:
        roles = live_roles_check(status.services, lambda address: health_check(address, timeout=PROBE_TIMEOUT_S))
        rollouts = [s for s in status.services if s.role == "rollout" and not s.stopped]
        behind = [f"{s.instance} (version {s.policy_version})" for s in rollouts if s.policy_version < 1]
        if not rollouts or behind:
            sync = Check(
                "weight-sync", "fail", f"no trained policy version reached {', '.join(behind) or 'any rollout'}"
            )
        else:
            versions = ", ".join(f"{s.instance} at version {s.policy_version}" for s in rollouts)
            versions += f" (trainer at {status.policy_version})"
            sync = logprobs_match(rows, versions) if rows else Check("weight-sync", "pass", versions)
    checks = [
        roles,
        sync,
        Check("smoke-run", "skip", "a live deployment is not restarted for a smoke run: `rlpipe run --smoke CONFIG`"),
        stored_checkpoint_check(cfg),
        drill_check(cfg),
        Check("metrics", "skip", f"{cfg.metrics_file} is not on this machine")
        if not cfg.metrics_file.is_file()
        else metrics_of(cfg, rows),
        *run_health_checks(cfg, rows),
        Check("tuning", "skip", "a live deployment runs no trial: `rlpipe verify --config CONFIG` runs one"),
    ]
    return checks, cfg, write_record(cfg, config_path, checks, time.monotonic() - started, settings, rows)
