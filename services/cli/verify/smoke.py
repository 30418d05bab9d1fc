"""The smoke run of ``rlpipe verify`` and ``rlpipe run --smoke``: the deployment started as ``rlpipe run`` does for a
few steps at a small batch under its own run id (``<run_id>-smoke``, so the deployment's own run is never touched),
its roles probed while it is up (gRPC health, metrics endpoints, the trainer's status), its stages scraped at the end.
services/cli/verify/checklist.py judges what it gathered.
"""

from __future__ import annotations

import json
import shutil
import signal
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.cli.healthcheck import check as health_check
from services.cli.launch.launcher import Launcher
from services.cli.verify.checkpoints import stores
from services.common.config import ConfigError, RunConfig, load_config, load_config_with
from services.common.observe.usage import ResourceTrend
from services.common.pb import admin_pb2, admin_pb2_grpc
from services.common.startup_checks.roles import startup_checks
from services.common.startup_checks.rows import StartupCheckError

SMOKE_SUFFIX = "-smoke"
SMOKE_STEPS = 3
SMOKE_BATCH = 2  # prompt groups per step
SMOKE_TIMEOUT_S = 900.0
# How long one probe of a role may take: a busy trainer answers its status between the parts of a step.
PROBE_TIMEOUT_S = 60.0
STAGE_OF_ROLE = {"rollout": "sampling", "reward": "reward", "reference": "reference"}


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
    config_path: Path  # the smoke config the services read, in the verification's folder
    started: bool = False
    finished: bool = False
    error: str = ""  # why the deployment did not start, or stopped short
    role_problems: list[str] = field(default_factory=list)
    role_evidence: str = ""
    scraped: dict[str, ServiceScrape] = field(default_factory=dict)  # service name -> its metrics
    resources: list[ResourceTrend] = field(default_factory=list)  # every role's processes, after the first step
    failed_services: list[str] = field(default_factory=list)


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
    outcome = SmokeRun(cfg, smoke_path)
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
    # Held until its roles are checked: a few steps of a tiny batch can be done before every stage has been seen
    # ready, and the roles must be probed while they are up.
    launcher = Launcher(cfg, smoke_path, resume=False, hold="rlpipe verify checks the roles first")
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(int(SMOKE_TIMEOUT_S))
    try:
        launcher.start()
        outcome.started = True
        outcome.role_problems, outcome.role_evidence = check_roles(cfg.run_dir)
        if not outcome.role_problems:  # a role down would stall the run: do not wait for it
            if isinstance(resumed := resume_trainer(cfg.run_dir), str):
                raise RuntimeError(f"the held smoke run could not be resumed: {resumed}")
            launcher.follow()
            outcome.finished = True
            outcome.resources = launcher.usage.resource_trends()
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
    status = trainer_status(info["admin"], (run_dir / "admin.token").read_text().strip())
    if isinstance(status, str):
        problems.append(f"trainer admin: {status}")
        return problems, ""
    down = [s.instance for s in status.services if not s.up and not s.stopped]  # stopped: ended in order
    problems += [f"{instance}: down in the trainer's status" for instance in down]
    evidence = (
        f"{', '.join(healthy)}: gRPC health SERVING, metrics endpoint answers; "
        f"trainer status: {sum(s.up for s in status.services)} services up"
    )
    return problems, evidence


def trainer_status(address: str, token: str, tls_ca: Path | None = None) -> admin_pb2.Status | str:
    """The trainer's Admin status (over TLS with ``tls_ca``), or why it could not be had."""
    return _admin_call(address, token, "GetStatus", admin_pb2.GetStatusRequest(), tls_ca)


def resume_trainer(run_dir: Path) -> admin_pb2.Status | str:
    """Resume the smoke run's trainer (``rlpipe resume``), or why it could not be."""
    info = json.loads((run_dir / "run.json").read_text())
    return _admin_call(
        info["admin"], (run_dir / "admin.token").read_text().strip(), "Resume", admin_pb2.ResumeRequest()
    )


def _admin_call(address: str, token: str, method: str, request: Any, tls_ca: Path | None = None) -> Any:
    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca.read_bytes()))
        if tls_ca
        else grpc.insecure_channel(address)
    )
    with channel:
        try:
            call = getattr(admin_pb2_grpc.AdminStub(channel), method)
            return call(request, timeout=PROBE_TIMEOUT_S, metadata=[("authorization", f"Bearer {token}")])
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
