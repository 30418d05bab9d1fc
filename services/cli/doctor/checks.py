"""``rlpipe doctor``: is this machine, with this config, ready for a run?

Each check reads the config (or only the machine) and returns rows of (name, status,
detail). ``rlpipe doctor`` runs them all and prints a table. The cheap subset a service
runs before it loads anything heavy lives in services/common/startup_checks/, shared
with the roles and the launcher; this module adds the machine checks (Python, pinned
packages; the GPU rows in doctor_gpu.py), the broker and stream probes (doctor_broker.py),
the disk estimate and the memory estimate (services/cli/plan.py).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import platform
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import yaml
from pydantic import BaseModel, ValidationError

from services.cli.doctor.broker import embedded_broker_rows, nats_rows
from services.cli.doctor.gpu import gpu_rows
from services.cli.doctor.model import model_rows as model_source_rows
from services.cli.doctor.network import network_rows
from services.cli.doctor.weightsync import weight_sync_rows
from services.cli.plan import gpus_at_hand, sizing_row
from services.cli.sizing import read_host_memory
from services.cli.verify.health import probe_remote, remote_services
from services.common.config import ConfigError, RunConfig, load_config
from services.common.observe.hardware import gpu_facts
from services.common.startup_checks.folders import dataset_rows, model_rows, weight_files
from services.common.startup_checks.machine import check_ports, check_python_box, role_ports
from services.common.startup_checks.rows import Check, CheckResult, human_size, run_each
from services.common.startup_checks.storage import storage_rows
from services.common.startup_checks.tokens import check_admin_read_token, check_admin_token
from services.common.transport.model_source import local_model_path

if TYPE_CHECKING:
    from rich.console import Console

LOCK_FILE = Path(__file__).resolve().parents[1] / "requirements.lock"
# Beside the environment's interpreter prefix: {"extras": [...], "lock": path, "requirements": path or null}.
INSTALL_RECORD = "rlpipe-install.json"
DOCTOR_DATASET_LINES = 100_000
# Weights plus AdamW's two moments of the same shape.
CHECKPOINT_WEIGHT_FACTOR = 3


# Machine checks: they need no config.


def check_python() -> CheckResult:
    from packaging.specifiers import SpecifierSet

    version = platform.python_version()
    try:
        required = ",".join(importlib.metadata.metadata("rlpipe").get_all("Requires-Python") or [])
    except importlib.metadata.PackageNotFoundError:
        return CheckResult(
            "python", "warn", f"{version}; the rlpipe package is not installed, so its Requires-Python is unknown"
        )
    if required and not SpecifierSet(required).contains(version):
        return CheckResult("python", "fail", f"{version} ({sys.executable}) but rlpipe requires {required}")
    return CheckResult("python", "ok", f"{version} ({sys.executable}), rlpipe requires {required or 'any'}")


def installed_closure(extras: list[str]) -> set[str]:
    """Canonical names of rlpipe and everything it needs with ``extras``, transitively, from installed metadata."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    needed: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [("rlpipe", frozenset(extras))]
    walked: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (canonicalize_name(name), wanted) in walked:
            continue
        walked.add((canonicalize_name(name), wanted))
        needed.add(canonicalize_name(name))
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed: the pin comparison names it
        for text in requires:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in (*wanted, "")):
                todo.append((requirement.name, frozenset(requirement.extras)))
    return needed


def install_record(prefix: Path | None = None) -> dict[str, Any] | None:
    """What deploy/install-python.sh installed into this environment (extras, lock, requirements), if it says."""
    record = Path(prefix or sys.prefix) / INSTALL_RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def check_packages(lock: Path | None = None, record: dict[str, Any] | None = None) -> CheckResult:
    """Installed versions against the ``==`` pins of a pip-freeze lock, by public version (2.13.0 == 2.13.0+cpu).

    Where the environment records how it was installed (``INSTALL_RECORD``, written by deploy/install-python.sh:
    every image and ``make install``), only the pins of what that install holds count: rlpipe with its recorded
    extras and their dependencies, and the packages of its extra requirements file, against the lock it used. A
    slim image without the test extra then passes without pytest."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    record = record if record is not None else install_record() if lock is None else None
    needed: set[str] | None = None
    if record is not None:
        lock = Path(record["lock"])
        needed = installed_closure(record.get("extras", []))
        if record.get("requirements"):
            needed |= {
                canonicalize_name(Requirement(line).name)
                for line in Path(record["requirements"]).read_text().splitlines()
                if line.strip() and not line.lstrip().startswith(("#", "-"))
            }
    lock = lock or LOCK_FILE
    if not lock.is_file():
        return CheckResult(
            "packages", "skip", f"no {lock.name} beside the code (an installed image): nothing to compare"
        )
    mismatched, missing, unreadable, pinned = [], [], [], 0
    for number, line in enumerate(lock.read_text().splitlines(), start=1):
        line = line.strip()
        # Comments and pip options (-e, --hash continuation lines) pin nothing.
        if not line or line.startswith(("#", "-")):
            continue
        try:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate():
                continue
            pins = [spec.version for spec in requirement.specifier if spec.operator == "=="]
            if len(pins) != 1:
                continue  # a direct URL or a range: not a pin to compare
            want = Version(pins[0])
        except (InvalidRequirement, InvalidVersion):
            unreadable.append(str(number))
            continue
        if needed is not None and canonicalize_name(requirement.name) not in needed:
            continue  # pinned for an extra this environment was not installed with
        pinned += 1
        try:
            have = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"{requirement.name}=={want}")
            continue
        try:
            same = Version(have).public == want.public
        except InvalidVersion:
            same = False
        if not same:
            mismatched.append(f"{requirement.name} {have} (lock {want})")
    problems = []
    if mismatched:
        problems.append("mismatched: " + ", ".join(mismatched))
    if missing:
        problems.append("missing: " + ", ".join(missing))
    if unreadable:
        problems.append(f"unreadable {lock.name} lines: {', '.join(unreadable)}")
    if problems:
        return CheckResult("packages", "fail", "; ".join(problems))
    return CheckResult("packages", "ok", f"{pinned} pinned packages match {lock}")


# Config checks.


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_disk(cfg: RunConfig) -> CheckResult:
    """Free space where file:// checkpoints go, against keep_last + 1 of them.

    One more than kept, as a new step lands before the oldest goes.
    """
    targets = [url for url in (cfg.checkpoint_url, cfg.checkpoint.mirror_url) if url.startswith("file://")]
    if not targets:
        return CheckResult("disk", "skip", f"checkpoints go to {cfg.checkpoint_url}: free space is the object store's")
    model = local_model_path(cfg.model)
    if model is None:
        return CheckResult("disk", "skip", f"{cfg.model.path} is not fetched yet: its size is unknown here")
    weights = sum(p.stat().st_size for p in weight_files(model))
    per_checkpoint = weights * CHECKPOINT_WEIGHT_FACTOR
    if cfg.train.algorithm == "ppo" and cfg.train.critic.kind == "separate":
        per_checkpoint *= 2  # the critic is a second backbone with its own moments
    count = cfg.checkpoint.keep_last + 1
    need = count * per_checkpoint
    free, enough = [], True
    for url in targets:
        where = _existing_ancestor(Path(unquote(urlparse(url).path)))
        available = shutil.disk_usage(where).free
        free.append(f"{human_size(available)} free at {where}")
        enough = enough and available >= need
    detail = f"need about {human_size(need)} ({count} checkpoints of ~{human_size(per_checkpoint)}); " + ", ".join(free)
    return CheckResult("disk", "ok" if enough else "fail", detail)


def remote_rows(cfg: RunConfig) -> list[CheckResult]:
    """Whether each remote service the config names (``reward.http``, ``rollout.environment_url``) accepts a
    connection from here: a reward or environment service out of reach holds every group until it answers."""
    named = remote_services(cfg)
    if not named:
        return [CheckResult("remote services", "skip", "the config names no remote reward or environment service")]
    rows = []
    for label, url in named.items():
        why = probe_remote(url)
        rows.append(
            CheckResult("remote services", "ok" if why is None else "fail", f"{label} {url}: {why or 'reachable'}")
        )
    return rows


def _doctor_checks(embedded: bool) -> list[Check]:
    ports_of = "run" if embedded else "doctor"
    return [
        Check("model", ("model", "reference"), lambda cfg: model_rows(cfg, policy=True, reference=True)),
        Check("model hash", ("model",), model_source_rows),
        Check("dataset", ("data",), lambda cfg: dataset_rows(cfg.data, DOCTOR_DATASET_LINES)),
        Check("storage", ("checkpoint",), storage_rows),
        Check("nats", ("nats",), embedded_broker_rows if embedded else nats_rows),
        Check(
            "ports",
            ("service", "admin", "telemetry"),
            lambda cfg: [check_ports(cfg.service.host, role_ports(cfg, ports_of))],
        ),
        Check(
            "admin token",
            ("admin",),
            lambda cfg: [check_admin_token(cfg, launcher_generates=embedded), *check_admin_read_token(cfg)],
        ),
        Check("weight-sync token", ("weight_sync", "service"), lambda cfg: weight_sync_rows(cfg, embedded)),
        Check("disk", ("model", "checkpoint", "train"), lambda cfg: [check_disk(cfg)]),
        Check("remote services", ("reward", "rollout"), remote_rows),
        Check("python tool box", ("rollout",), lambda cfg: check_python_box(cfg.rollout)),
        Check(
            "sizing",
            ("model", "train", "sampling", "rollout", "reference", "trainer"),
            lambda cfg: [sizing_row(cfg, gpus_at_hand(), read_host_memory())],
        ),
    ]


def run_checks(
    cfg: RunConfig | None, *, embedded: bool = False, invalid: frozenset[str] = frozenset(), network: bool = False
) -> list[CheckResult]:
    """Every check: the machine's, then the config's.

    A config check is skipped where ``cfg`` is None or the fields it reads are ``invalid``.

    ``embedded``: the config is for ``rlpipe run``, which starts its own broker and picks the
    trainer's port, so the nats-server binary is checked instead of ``nats.url``. ``network``: the timed network
    rows too (services/cli/doctor/network.py).
    Not for a running event loop: the NATS probe runs its own.
    """
    checks = _doctor_checks(embedded)
    if network:
        fields = ("nats", "checkpoint", "reward", "rollout", "model", "train", "sampling", "telemetry", "supervision")
        checks.append(Check("network", fields, lambda cfg: network_rows(cfg, embedded)))
    return [
        check_python(),
        check_packages(),
        *gpu_rows(gpu_facts()),
        *run_each(checks, cfg, invalid),
    ]


def _partial_config(path: Path) -> tuple[RunConfig | None, frozenset[str]]:
    """The config with each invalid section kept as given but unvalidated, and the names of those sections.

    None when a top-level value that is not a section is invalid (or the file is unreadable):
    too much depends on run_id and runs_dir to guess them.
    """
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None, frozenset()
    if not isinstance(data, dict):
        return None, frozenset()
    invalid: set[str] = set()
    while True:
        try:
            return RunConfig(**data), frozenset(invalid)
        except ValidationError as error:
            bad = {str(item["loc"][0]) for item in error.errors() if item["loc"]}
        if not bad or bad <= invalid:
            return None, frozenset()  # the environment overrides a placeholder with a bad value, or a root error
        for name in bad - invalid:
            field = RunConfig.model_fields.get(name)
            if field is None:
                data.pop(name, None)  # an unknown key: nothing reads it
                continue
            section, given = field.annotation, data.get(name, {})
            if not (isinstance(section, type) and issubclass(section, BaseModel) and isinstance(given, dict)):
                return None, frozenset()
            # A model instance is taken as is (pydantic does not revalidate instances), so the rest validates.
            data[name] = section.model_construct(**given)
            invalid.add(name)


def diagnose(config_path: Path, *, embedded: bool = False, network: bool = False) -> list[CheckResult]:
    """``rlpipe doctor``: the config's own row first, then every check that a (possibly partial) config allows."""
    try:
        cfg, invalid = load_config(config_path), frozenset()
        config_row = CheckResult(
            "config", "ok", f"{config_path}: run {cfg.run_id!r}, environment {cfg.environment or 'unset'}"
        )
    except ConfigError as error:
        config_row = CheckResult("config", "fail", f"{config_path}: {error}")
        cfg, invalid = _partial_config(config_path)
    return [config_row, *run_checks(cfg, embedded=embedded, invalid=invalid, network=network)]


STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def print_report(results: list[CheckResult], console: Console | None = None) -> int:
    """The table, then one unwrapped line per failure; returns the exit code (1 if any check failed)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    table = Table(title="rlpipe doctor")
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for result in results:
        table.add_row(result.name, Text(result.status, style=STYLES[result.status]), Text(result.detail))
    console.print(table)
    say = functools.partial(console.print, markup=False, highlight=False, soft_wrap=True)  # greppable: plain, unwrapped
    failures = [result for result in results if result.failed]
    for result in failures:
        say(f"FAIL {result.name}: {result.detail}")
    if failures:
        say(f"rlpipe doctor: {len(failures)} failed: {', '.join(result.name for result in failures)}")
        return 1
    warnings = sum(result.status == "warn" for result in results)
    say(f"rlpipe doctor: no check failed ({warnings} warning{'' if warnings == 1 else 's'})")
    return 0
