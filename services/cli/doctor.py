"""``rlpipe doctor``: is this machine, with this config, ready for a run?

Each check reads the config (or only the machine) and returns rows of (name, status,
detail). ``rlpipe doctor`` runs them all and prints a table. The cheap subset a service
runs before it loads anything heavy lives in services/common/startup_checks.py, shared
with the roles and the launcher; this module adds the machine checks (Python, pinned
packages, GPU), the broker and stream probes, the disk estimate and the memory estimate (services/cli/plan.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import json
import math
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import yaml
from pydantic import BaseModel, ValidationError

from services.cli.plan import gpus_at_hand, sizing_row
from services.common.config import ConfigError, RunConfig, load_config
from services.common.model.sizing import read_host_memory
from services.common.observe.hardware import GpuFacts, gpu_facts, release_numbers
from services.common.startup_checks import (
    Check,
    CheckResult,
    Status,
    check_admin_token,
    check_ports,
    cuda_failure,
    dataset_rows,
    human_size,
    model_rows,
    role_ports,
    run_each,
    shorten,
    storage_rows,
    weight_files,
)
from services.common.transport.nats_connect import connect_options, message_limit_refusal
from services.common.transport.nats_server import nats_server_binary

if TYPE_CHECKING:
    from rich.console import Console

LOCK_FILE = Path(__file__).resolve().parents[1] / "requirements.lock"
# Beside the environment's interpreter prefix: {"extras": [...], "lock": path, "requirements": path or null}.
INSTALL_RECORD = "rlpipe-install.json"
NETWORK_TIMEOUT_S = 3.0
DOCTOR_DATASET_LINES = 100_000
# Weights plus AdamW's two moments of the same shape.
CHECKPOINT_WEIGHT_FACTOR = 3


# Machine checks: they need no config.


def check_python() -> CheckResult:
    from packaging.specifiers import SpecifierSet

    version = platform.python_version()
    try:
        required = importlib.metadata.metadata("rlpipe").get("Requires-Python") or ""
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


# GPU checks: pure decisions over the facts services/common/observe/hardware.py gathers, so each branch is
# tested on a machine without a GPU by handing it the facts of one.


def gpu_row(facts: GpuFacts) -> CheckResult:
    """A GPU the driver shows but CUDA cannot open fails, naming why: CUDA code would run on the CPU or not at all."""
    if not facts.cuda_available:
        if not facts.gpu_seen:
            return CheckResult("gpu", "ok", f"no GPU (CPU run), torch {facts.torch_version}")
        return CheckResult(
            "gpu", "fail", f"a GPU is present ({facts.gpu_seen}) but CUDA does not initialize: {cuda_failure(facts)}"
        )
    names = facts.devices
    devices = f"{len(names)}x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    driver = facts.driver_version or "unknown"
    return CheckResult("gpu", "ok", f"{devices}; torch {facts.torch_version}, CUDA {facts.torch_cuda}, driver {driver}")


def cuda_versions_row(facts: GpuFacts) -> CheckResult:
    """torch's CUDA against the newest CUDA the driver supports.

    An older driver major cannot run the build at all; an older minor of the same major runs
    through CUDA's minor-version compatibility, where code JIT-compiled from PTX (Triton's
    kernels, vLLM's) can still fail, hence a warning.
    """
    if not facts.cuda_available and not facts.gpu_seen:
        return CheckResult("cuda", "skip", "no GPU")
    if facts.torch_cuda is None:
        return CheckResult("cuda", "skip", f"torch {facts.torch_version} is a CPU-only build (see gpu)")
    built = f"torch {facts.torch_version} is built for CUDA {facts.torch_cuda}"
    if facts.driver_cuda is None:
        return CheckResult(
            "cuda", "warn", f"{built}; the driver's CUDA version is unknown (NVML did not load, nvidia-smi did not say)"
        )
    driver = f"driver {facts.driver_version or '(version unknown)'} supports CUDA up to {facts.driver_cuda}"
    want, have = release_numbers(facts.torch_cuda)[:2], release_numbers(facts.driver_cuda)[:2]
    if have[:1] < want[:1]:
        return CheckResult(
            "cuda",
            "fail",
            f"{built} but the {driver}: upgrade the driver, or install a torch built for CUDA {have[0]}.x",
        )
    if have < want:
        return CheckResult(
            "cuda",
            "warn",
            f"{built} but the {driver}: it runs by minor-version compatibility, and kernels compiled at run time "
            "(Triton, vLLM) may fail; upgrade the driver",
        )
    return CheckResult("cuda", "ok", f"{built}; {driver}")


def nccl_row(facts: GpuFacts) -> CheckResult:
    """The NCCL torch loaded: present (needed with more than one GPU), for torch's CUDA major, and the wheel's own."""
    if not facts.cuda_available:
        return CheckResult("nccl", "skip", "no CUDA")
    if facts.nccl is None:
        # One GPU trains without NCCL; more than one cannot share gradients.
        status: Status = "warn" if len(facts.devices) <= 1 else "fail"
        return CheckResult("nccl", status, f"NCCL unavailable: {facts.nccl_error[:120]}")
    if facts.nccl_wheel is None:
        return CheckResult("nccl", "ok", f"NCCL {facts.nccl} (no nvidia-nccl wheel: linked into torch or the system's)")
    wheel, wheel_version = facts.nccl_wheel
    wheel_cuda = int(wheel.removeprefix("nvidia-nccl-cu"))  # gpu_facts matched nvidia-nccl-cu<digits>
    torch_major = release_numbers(facts.torch_cuda or "")[:1]
    if torch_major and wheel_cuda != torch_major[0]:
        return CheckResult(
            "nccl",
            "fail",
            f"{wheel} {wheel_version} is built for CUDA {wheel_cuda} but torch for CUDA {facts.torch_cuda}: "
            f"install nvidia-nccl-cu{torch_major[0]}",
        )
    if release_numbers(wheel_version)[:3] != release_numbers(facts.nccl)[:3]:
        return CheckResult(
            "nccl",
            "warn",
            f"torch loaded NCCL {facts.nccl} but {wheel} is {wheel_version}: another libnccl "
            "(LD_LIBRARY_PATH, a system install) shadows the wheel's",
        )
    return CheckResult("nccl", "ok", f"NCCL {facts.nccl} ({wheel} {wheel_version})")


def vllm_row(facts: GpuFacts) -> CheckResult:
    """The torch vLLM was built against is the torch installed: its compiled ops load against no other."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if facts.vllm is None:
        return CheckResult("vllm", "skip", "vLLM is not installed (the rollout needs it: the vllm extra)")
    dist, version = facts.vllm
    if not facts.vllm_torch:
        return CheckResult("vllm", "ok", f"{dist} {version} names no torch requirement on this platform")
    try:
        wanted = SpecifierSet(facts.vllm_torch)
    except InvalidSpecifier:
        return CheckResult("vllm", "warn", f"{dist} {version} requires torch {facts.vllm_torch!r}, which is unreadable")
    if not wanted.contains(facts.torch_version, prereleases=True):
        return CheckResult(
            "vllm",
            "fail",
            f"{dist} {version} requires torch{facts.vllm_torch} but torch {facts.torch_version} is installed: "
            "install the torch it pins (requirements.lock; deploy/requirements-cuda.txt on a GPU machine)",
        )
    return CheckResult(
        "vllm", "ok", f"{dist} {version} requires torch{facts.vllm_torch}; torch {facts.torch_version} is installed"
    )


def gpu_rows(facts: GpuFacts) -> list[CheckResult]:
    return [gpu_row(facts), cuda_versions_row(facts), nccl_row(facts), vllm_row(facts)]


# Config checks.


def _shown(value: Any) -> str:
    value = getattr(value, "value", value)  # enums as the server spells them
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _same(want: Any, have: Any) -> bool:
    if have is None:
        return False
    if isinstance(want, (int, float)) and not isinstance(want, bool) and isinstance(have, (int, float)):
        # Durations travel as nanoseconds and come back as float seconds.
        return math.isclose(float(want), float(have), rel_tol=1e-9)
    if isinstance(want, list) and isinstance(have, list):
        return sorted(map(str, want)) == sorted(map(str, have))
    if isinstance(want, dict) and isinstance(have, dict):
        return all(have.get(key) == value for key, value in want.items())  # the server adds its own metadata
    return want == have


def stream_differences(expected: Any, actual: Any) -> list[tuple[str, str, str]]:
    """(setting, expected, found) for each setting ``Bus.stream_config`` chooses that the live stream does not have.

    A setting the bus leaves at the client default is the server's to choose, so it is not compared.
    """
    from nats.js import api

    defaults = api.StreamConfig()
    differences = []
    for field in dataclasses.fields(api.StreamConfig):
        want = getattr(expected, field.name)
        if want is None or want == getattr(defaults, field.name):
            continue
        have = getattr(actual, field.name)
        if not _same(want, have):
            differences.append((field.name, _shown(want), _shown(have)))
    return differences


async def _probe_nats(cfg: RunConfig) -> list[CheckResult]:
    import nats
    from nats.js.errors import NotFoundError

    from services.common.transport.bus import Bus
    from services.common.transport.streams import EDGES

    url = cfg.nats.url
    errors: list[BaseException] = []

    async def remember(error: BaseException) -> None:
        # Reported once in the row, not logged per attempt.
        errors.append(error)

    try:
        nc = await asyncio.wait_for(
            nats.connect(
                url,
                connect_timeout=NETWORK_TIMEOUT_S,
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0.1,
                error_cb=remember,
                name="rlpipe-doctor",
                **connect_options(cfg.nats, "operator"),
            ),
            NETWORK_TIMEOUT_S,
        )
    except Exception as error:  # refused, unresolvable, timed out: all mean no broker
        cause = errors[-1] if errors else error
        hint = "a config for rlpipe run, which starts its own broker, is checked with --embedded"
        return [
            CheckResult("nats", "fail", f"cannot connect to {url}: {shorten(cause)} ({hint})"),
            CheckResult("streams", "skip", "no broker to ask"),
        ]
    try:
        js = nc.jetstream(timeout=NETWORK_TIMEOUT_S)
        try:
            await js.account_info()
        except Exception as error:  # no responders, timeout or an API error: all mean no usable JetStream
            return [
                CheckResult("nats", "fail", f"{url}: JetStream is not enabled for this account: {shorten(error)}"),
                CheckResult("streams", "skip", "no JetStream to ask"),
            ]
        nats_row = CheckResult("nats", "ok", f"{url}: nats-server {nc.connected_server_version}, JetStream enabled")
        refusal = message_limit_refusal(cfg.nats.max_message_bytes, nc.max_payload)
        if refusal:  # every service would refuse to start against this broker
            nats_row = CheckResult("nats", "fail", f"{url}: {refusal}")
        bus = Bus(cfg, "doctor")
        found, problems = [], []
        for edge in EDGES:
            expected = bus.stream_config(edge)
            try:
                actual = (await js.stream_info(expected.name)).config
            except NotFoundError:
                continue
            found.append(expected.name)
            for setting, want, have in stream_differences(expected, actual):
                problems.append(f"{expected.name}: {setting} expected {want}, found {have}")
        if problems:
            streams_row = CheckResult("streams", "fail", "; ".join(problems))
        elif found:
            streams_row = CheckResult(
                "streams", "ok", f"{len(found)} of the run's {len(EDGES)} streams exist and match the config"
            )
        else:
            streams_row = CheckResult(
                "streams", "ok", f"none of the run's {len(EDGES)} streams exist yet: they are created at start"
            )
        return [nats_row, streams_row]
    finally:
        await nc.close()


def _nats_rows(cfg: RunConfig) -> list[CheckResult]:
    return asyncio.run(_probe_nats(cfg))


def _embedded_broker_rows(cfg: RunConfig) -> list[CheckResult]:
    streams = CheckResult("streams", "skip", "rlpipe run creates the embedded broker's streams")
    try:
        binary = nats_server_binary()
        out = subprocess.run([binary, "--version"], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as error:
        return [CheckResult("nats", "fail", f"rlpipe run cannot start its broker: {shorten(error)}"), streams]
    if out.returncode != 0:
        return [
            CheckResult("nats", "fail", f"{binary} --version exited with {out.returncode}: {shorten(out.stderr)}"),
            streams,
        ]
    return [
        CheckResult(
            "nats", "ok", f"rlpipe run starts its own broker, {out.stdout.strip()} ({binary}); nats.url is not used"
        ),
        streams,
    ]


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
    weights = sum(p.stat().st_size for p in weight_files(cfg.model.path))
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


def _doctor_checks(embedded: bool) -> list[Check]:
    ports_of = "run" if embedded else "doctor"
    return [
        Check("model", ("model", "reference"), lambda cfg: model_rows(cfg, policy=True, reference=True)),
        Check("dataset", ("data",), lambda cfg: dataset_rows(cfg, DOCTOR_DATASET_LINES)),
        Check("storage", ("checkpoint",), storage_rows),
        Check("nats", ("nats",), _embedded_broker_rows if embedded else _nats_rows),
        Check(
            "ports",
            ("service", "admin", "telemetry"),
            lambda cfg: [check_ports(cfg.service.host, role_ports(cfg, ports_of))],
        ),
        Check("admin token", ("admin",), lambda cfg: [check_admin_token(cfg, launcher_generates=embedded)]),
        Check("disk", ("model", "checkpoint", "train"), lambda cfg: [check_disk(cfg)]),
        Check(
            "sizing",
            ("model", "train", "sampling", "rollout", "reference", "trainer"),
            lambda cfg: [sizing_row(cfg, gpus_at_hand(), read_host_memory())],
        ),
    ]


def run_checks(
    cfg: RunConfig | None, *, embedded: bool = False, invalid: frozenset[str] = frozenset()
) -> list[CheckResult]:
    """Every check: the machine's, then the config's.

    A config check is skipped where ``cfg`` is None or the fields it reads are ``invalid``.

    ``embedded``: the config is for ``rlpipe run``, which starts its own broker and picks the
    trainer's port, so the nats-server binary is checked instead of ``nats.url``.
    Not for a running event loop: the NATS probe runs its own.
    """
    return [
        check_python(),
        check_packages(),
        *gpu_rows(gpu_facts()),
        *run_each(_doctor_checks(embedded), cfg, invalid),
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


def diagnose(config_path: Path, *, embedded: bool = False) -> list[CheckResult]:
    """``rlpipe doctor``: the config's own row first, then every check that a (possibly partial) config allows."""
    try:
        cfg, invalid = load_config(config_path), frozenset()
        config_row = CheckResult(
            "config", "ok", f"{config_path}: run {cfg.run_id!r}, environment {cfg.environment or 'unset'}"
        )
    except ConfigError as error:
        config_row = CheckResult("config", "fail", f"{config_path}: {error}")
        cfg, invalid = _partial_config(config_path)
    return [config_row, *run_checks(cfg, embedded=embedded, invalid=invalid)]


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
    plain = {"markup": False, "highlight": False, "soft_wrap": True}  # greppable: never styled or wrapped
    failures = [result for result in results if result.failed]
    for result in failures:
        console.print(f"FAIL {result.name}: {result.detail}", **plain)
    if failures:
        console.print(
            f"rlpipe doctor: {len(failures)} failed: {', '.join(result.name for result in failures)}", **plain
        )
        return 1
    warnings = sum(result.status == "warn" for result in results)
    console.print(f"rlpipe doctor: no check failed ({warnings} warning{'' if warnings == 1 else 's'})", **plain)
    return 0
