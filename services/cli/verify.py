"""``rlpipe verify`` and ``rlpipe run --smoke``: the operations guide's post-deployment checklist as commands.

``rlpipe verify`` starts the deployment as ``rlpipe run`` does, for a smoke run of a few
steps at a small batch under its own run id (``<run_id>-smoke``, so the deployment's own run
is never touched), and checks, in order:

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

Against a running deployment (``rlpipe --address ADMIN verify``, ``verify_live``) nothing is started:
the roles and rollout versions come from the trainer's status, the rest from the run's own files and
stores, and the smoke run is skipped.

A check whose evidence never came (the deployment did not start) is ``skip``. The record,
``verify.json`` and a short ``verify.md``, goes into the smoke run's directory; the exit code
is 1 when any check failed, and each failed check is named.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.cli.alert_drill import run_drill
from services.cli.checkpoint_verify import stores, verify_checkpoints
from services.cli.healthcheck import check as health_check
from services.cli.launcher import Launcher
from services.cli.report import read_jsonl
from services.common.config import ConfigError, RunConfig, load_config, load_config_with
from services.common.pb import admin_pb2, admin_pb2_grpc
from services.common.startup_checks import StartupCheckError, startup_checks
from services.trainer.samples import SampleArchive

SMOKE_SUFFIX = "-smoke"
SMOKE_STEPS = 3
SMOKE_BATCH = 2  # prompt groups per step
SMOKE_TIMEOUT_S = 900.0
# Mean per-token |log pi_sampler - log pi_trainer| allowed on groups the trainer's current version generated:
# the same weights in two engines differ by rounding (~1e-4 in float32), a missed or torn sync by far more.
LOGPROB_TOLERANCE = 0.02
# How long one probe of a role may take: a busy trainer answers its status between the parts of a step.
PROBE_TIMEOUT_S = 60.0
CURVES = ("entropy", "reward_mean", "reward_std", "kl_ref", "response_length_mean", "termination_rate")
STAGE_OF_ROLE = {"rollout": "sampling", "reward": "reward", "reference": "reference"}

Status = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str  # the evidence, or what failed


@dataclass(frozen=True)
class ServiceScrape:
    """What one stage replica's metrics endpoint showed at the end of the smoke run."""

    role: str
    groups_ok: float  # rlpipe_groups_processed_total{outcome="ok"}
    policy_version: float | None  # rlpipe_rollout_policy_version (rollouts only)
    error: str = ""


@dataclass
class SmokeRun:
    cfg: RunConfig
    started: bool = False
    finished: bool = False
    error: str = ""  # why the deployment did not start, or stopped short
    role_problems: list[str] = field(default_factory=list)
    role_evidence: str = ""
    scraped: dict[str, ServiceScrape] = field(default_factory=dict)  # service name -> its metrics
    failed_services: list[str] = field(default_factory=list)


# -- the smoke run ------------------------------------------------------------------------------


def smoke_overrides(run_id: str) -> dict[str, Any]:
    """Dotted fields a smoke run sets over the deployment's config."""
    return {
        "run_id": run_id[: 64 - len(SMOKE_SUFFIX)] + SMOKE_SUFFIX,
        "metrics_path": None,  # in the smoke run's own directory, never the deployment's metrics file
        "train.total_steps": SMOKE_STEPS,
        "train.batch_size": SMOKE_BATCH,
        # One update per step: its approx_kl then compares the sampler's logprobs with the trainer's before it.
        "train.epochs": 1,
        "train.mini_batches": 1,
        "rollout.prompts_per_batch": SMOKE_BATCH,
        "data.eval_path": None,  # evaluation is not on the checklist, and the slowest part of a short run
        "data.eval_every_steps": 0,
        "checkpoint.save_every_steps": 0,  # the final save only
        "telemetry.samples_keep_steps": SMOKE_STEPS,
    }


def write_smoke_config(
    config_path: Path, folder: Path, settings: Mapping[str, Any] | None = None
) -> tuple[Path, RunConfig]:
    """The deployment's YAML with the user's ``settings`` (command-line overrides) and then the smoke overrides,
    written to ``folder``; returns its path and the loaded config.

    Raises ConfigError when the config or a setting is invalid, when a setting is one the smoke run sets itself,
    or when an ``RLPIPE_*`` variable overrides such a field (an RLPIPE_RUN_ID would point it at the deployment's
    own run)."""
    base, data = load_config_with(config_path, settings or {})
    overrides = smoke_overrides(base.run_id)
    taken = sorted(set(settings or {}) & set(overrides))
    if taken:
        raise ConfigError(
            f"override {', '.join(taken)}: set by the smoke run itself (a short run of its own); override other fields"
        )
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = folder / f"{overrides['run_id']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(path)
    dumped = cfg.model_dump()
    overridden = [key for key, value in overrides.items() if _dotted(dumped, key) != value]
    if overridden:
        raise ConfigError(
            f"invalid configuration:\n  {', '.join(overridden)}: set by RLPIPE_* environment variables, which win "
            "over the smoke run's values; unset them for `rlpipe verify` / `rlpipe run --smoke`"
        )
    return path, cfg


def _dotted(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def _timed_out(signum: int, frame: Any) -> None:
    raise TimeoutError(f"the smoke run did not finish within {SMOKE_TIMEOUT_S:g}s")


def smoke(config_path: Path, folder: Path, settings: Mapping[str, Any] | None = None) -> SmokeRun:
    """Start the deployment for a smoke run, check its roles while it is up, let it finish, stop it.

    The smoke config lives in ``folder`` for the run's duration (services read it again when restarted)."""
    smoke_path, cfg = write_smoke_config(config_path, folder, settings)
    outcome = SmokeRun(cfg)
    try:
        startup_checks(cfg, "run")
    except StartupCheckError as error:
        outcome.error = f"not started: {error}"
        return outcome
    # The smoke run id is the smoke's own: an earlier smoke's directory and checkpoints go.
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    cfg.metrics_file.unlink(missing_ok=True)
    try:
        for store in stores(cfg):
            store.delete_prefix(f"{cfg.run_id}/")
    except Exception as error:  # an unreachable store fails the start like a failed start-up check
        outcome.error = f"not started: checkpoint store: {error!r}"[:500]
        return outcome
    cfg.run_dir.mkdir(parents=True)
    launcher = Launcher(cfg, smoke_path, resume=False)
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(int(SMOKE_TIMEOUT_S))
    try:
        launcher.start()
        outcome.started = True
        outcome.role_problems, outcome.role_evidence = check_roles(cfg.run_dir)
        if not outcome.role_problems:  # a role down would stall the run: do not wait for it
            launcher.follow()
            outcome.finished = True
            outcome.scraped = scrape_stages(cfg.run_dir)
    except (RuntimeError, TimeoutError, KeyboardInterrupt) as error:
        outcome.error = str(error) or type(error).__name__
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        outcome.failed_services = launcher.stop()
    return outcome


def check_roles(run_dir: Path) -> tuple[list[str], str]:
    """(problems, evidence) for every service in run.json: gRPC health, metrics endpoint, the trainer's view."""
    info = json.loads((run_dir / "run.json").read_text())
    problems, healthy = [], []
    for name, service in sorted(info["services"].items()):
        found = []
        if service.get("grpc"):
            reason = health_check(service["grpc"], timeout=PROBE_TIMEOUT_S)
            if reason:
                found.append(f"health {reason}")
        if service.get("metrics_url"):
            try:
                with urllib.request.urlopen(service["metrics_url"], timeout=PROBE_TIMEOUT_S) as response:
                    response.read()
            except OSError as error:
                found.append(f"metrics endpoint {service['metrics_url']}: {error}")
        problems += [f"{name}: {problem}" for problem in found]
        if not found:
            healthy.append(name)
    status = _trainer_status(info["admin"], (run_dir / "admin.token").read_text().strip())
    if isinstance(status, str):
        problems.append(f"trainer admin: {status}")
        return problems, ""
    down = [s.instance for s in status.services if not s.up]
    problems += [f"{instance}: down in the trainer's status" for instance in down]
    evidence = (
        f"{', '.join(healthy)}: gRPC health SERVING, metrics endpoint answers; "
        f"trainer status: {sum(s.up for s in status.services)} services up"
    )
    return problems, evidence


def _trainer_status(address: str, token: str, tls_ca: Path | None = None) -> admin_pb2.Status | str:
    """The trainer's Admin status (over TLS with ``tls_ca``), or why it could not be had."""
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca.read_bytes()))
        if tls_ca
        else grpc.insecure_channel(address)
    )
    with channel:
        try:
            return admin_pb2_grpc.AdminStub(channel).GetStatus(
                admin_pb2.GetStatusRequest(), timeout=PROBE_TIMEOUT_S, metadata=[("authorization", f"Bearer {token}")]
            )
        except grpc.RpcError as error:
            return f"{address}: {error.code().name}: {error.details()}"


def scrape_stages(run_dir: Path) -> dict[str, ServiceScrape]:
    """Every stage replica's processed groups (and a rollout's loaded version) from its metrics endpoint."""
    info = json.loads((run_dir / "run.json").read_text())
    scraped = {}
    for name, service in sorted(info["services"].items()):
        if service["role"] not in STAGE_OF_ROLE:
            continue
        try:
            with urllib.request.urlopen(service["metrics_url"], timeout=PROBE_TIMEOUT_S) as response:
                text = response.read().decode()
        except (OSError, KeyError) as error:
            scraped[name] = ServiceScrape(service["role"], 0.0, None, f"metrics not scraped: {error!r}")
            continue
        groups, version = 0.0, None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "rlpipe_groups_processed_total" and sample.labels.get("outcome") == "ok":
                    groups += sample.value
                elif sample.name == "rlpipe_rollout_policy_version":
                    version = sample.value
        scraped[name] = ServiceScrape(service["role"], groups, version)
    return scraped


# -- the checks ---------------------------------------------------------------------------------


def step_rows(cfg: RunConfig) -> list[dict[str, Any]]:
    return [row for row in read_jsonl(cfg.metrics_file) if "reward_mean" in row]


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


def weight_sync_check(run: SmokeRun, rows: list[dict[str, Any]]) -> Check:
    if not run.finished:
        return Check("weight-sync", "skip", "the smoke run did not finish")
    rollouts = {name: s for name, s in run.scraped.items() if s.role == "rollout"}
    behind = [
        f"{name} ({s.error or f'version {s.policy_version}'})" for name, s in rollouts.items() if not s.policy_version
    ]
    if not rollouts or behind:
        return Check("weight-sync", "fail", f"no trained policy version reached {', '.join(behind) or 'any rollout'}")
    versions = ", ".join(f"{name} at version {int(s.policy_version)}" for name, s in rollouts.items())
    return logprobs_match(rows, versions)


def logprobs_match(rows: list[dict[str, Any]], versions: str) -> Check:
    """The weight-sync check once every rollout has a trained version (``versions`` says which): the sampler's
    logprobs against the trainer's on the steps that trained on groups of the trainer's current version."""
    fresh = [row for row in rows if row.get("staleness_max") == 0 and "approx_kl" in row]
    if not fresh:
        return Check("weight-sync", "fail", "no step trained on groups of the trainer's current version to compare")
    apart = [row for row in fresh if not abs(row["approx_kl"]) <= LOGPROB_TOLERANCE]
    compared = ", ".join(f"step {r['step']}: {r['approx_kl']:.2e}" for r in fresh[-5:])
    if apart:
        return Check(
            "weight-sync", "fail", f"sampler and trainer logprobs differ beyond {LOGPROB_TOLERANCE}: {compared}"
        )
    return Check("weight-sync", "pass", f"{versions}; logprob gap (approx_kl) {compared}")


def smoke_check(run: SmokeRun, rows: list[dict[str, Any]]) -> Check:
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


def metrics_check(run: SmokeRun, rows: list[dict[str, Any]]) -> Check:
    if not rows and not run.started:
        return Check("metrics", "skip", f"no step rows in {run.cfg.metrics_file}")
    return metrics_of(run.cfg, rows)


def metrics_of(cfg: RunConfig, rows: list[dict[str, Any]]) -> Check:
    """The training curves the guide asks for, in every step row, finite."""
    if not rows:
        return Check("metrics", "fail", f"no step rows in {cfg.metrics_file}")
    empty = [key for key in CURVES if not all(_finite(row.get(key)) for row in rows)]
    if empty:
        return Check("metrics", "fail", f"missing or not finite in some of {len(rows)} step rows: {', '.join(empty)}")
    last = rows[-1]
    return Check("metrics", "pass", ", ".join(f"{key} {last[key]:.4g}" for key in CURVES) + f" (step {last['step']})")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# -- the record ---------------------------------------------------------------------------------


def write_record(
    cfg: RunConfig, config_path: Path, checks: list[Check], took_s: float, settings: Mapping[str, Any] | None = None
) -> tuple[Path, Path]:
    failed = [c.name for c in checks if c.status == "fail"]
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": str(config_path),
        "overrides": dict(settings or {}),
        "run_id": cfg.run_id,
        "passed": not failed,
        "failed": failed,
        "took_s": round(took_s, 1),
        "checks": [asdict(c) for c in checks],
    }
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    as_json, as_md = cfg.run_dir / "verify.json", cfg.run_dir / "verify.md"
    as_json.write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        f"# Verification of {config_path}",
        "",
        *([f"Overrides: `{' '.join(f'{k}={v}' for k, v in settings.items())}`", ""] if settings else []),
        f"{record['time']}, smoke run `{cfg.run_id}`, {record['took_s']} s: "
        + ("**passed**" if not failed else f"**failed**: {', '.join(failed)}"),
        "",
        "| check | result | evidence |",
        "|---|---|---|",
        *(f"| {c.name} | {c.status} | {c.detail.replace('|', '/')} |" for c in checks),
    ]
    as_md.write_text("\n".join(lines) + "\n")
    return as_json, as_md


def verify(
    config_path: Path, settings: Mapping[str, Any] | None = None
) -> tuple[list[Check], RunConfig, tuple[Path, Path]]:
    """Run the checklist against the embedded deployment, the config file with ``settings`` (dotted overrides)
    over it; raises ConfigError for a config that cannot start."""
    started = time.monotonic()
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
    ]
    return checks, run.cfg, write_record(run.cfg, config_path, checks, time.monotonic() - started, settings)


def smoke_only(config_path: Path) -> list[Check]:
    """``rlpipe run --smoke``: the smoke run with its role and stage checks."""
    with tempfile.TemporaryDirectory(prefix="rlpipe-smoke-") as folder:
        run = smoke(config_path, Path(folder))
    return [roles_check(run), smoke_check(run, step_rows(run.cfg))]


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
    status = _trainer_status(address, token, tls_ca)
    if isinstance(status, str):
        roles = Check("roles", "fail", f"trainer admin: {status}")
        sync = Check("weight-sync", "skip", "the trainer's status could not be read")
    else:
        problems = [f"{s.instance}: down in the trainer's status" for s in status.services if not s.up]
        for service in status.services:
            reason = health_check(service.grpc_address, timeout=PROBE_TIMEOUT_S) if service.grpc_address else None
            if service.up and reason:
                problems.append(f"{service.instance}: health {reason}")
        up = [s.instance for s in status.services if s.up]
        roles = (
            Check("roles", "fail", "; ".join(problems))
            if problems
            else Check("roles", "pass", f"{', '.join(up)}: up in the trainer's status, gRPC health SERVING")
        )
        rollouts = [s for s in status.services if s.role == "rollout"]
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
    ]
    return checks, cfg, write_record(cfg, config_path, checks, time.monotonic() - started, settings)
