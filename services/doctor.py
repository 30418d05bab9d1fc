"""``rlpipe doctor``: is this machine, with this config, ready for a run?

Each check reads the config (or only the machine) and returns rows of (name, status,
detail). ``rlpipe doctor`` runs them all and prints a table; ``startup_checks`` is the
cheap subset a service runs before it loads anything heavy, so a bad model folder or an
unwritable store stops it at once, with every reason named, instead of minutes later.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote, urlparse

import yaml
from pydantic import BaseModel, ValidationError

from services.common.config import AdminCredentials, CheckpointConfig, ConfigError, RunConfig, load_config
from services.common.datasets import row_problem

if TYPE_CHECKING:
    from rich.console import Console

Status = Literal["ok", "warn", "fail", "skip"]

LOCK_FILE = Path(__file__).resolve().parents[1] / "requirements.lock"
NETWORK_TIMEOUT_S = 3.0
# An S3 probe is four requests (bucket, put, get, delete); a dead endpoint must not stall start-up.
STORAGE_TIMEOUT_S = 5.0
DOCTOR_DATASET_LINES = 100_000
STARTUP_DATASET_LINES = 1_000
SHOWN_BAD_LINES = 5
# Weights plus AdamW's two moments of the same shape.
CHECKPOINT_WEIGHT_FACTOR = 3
STARTUP_ROLES = ("trainer", "rollout", "reward", "reference", "run")


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == "fail"


@dataclass(frozen=True)
class Check:
    """A config-dependent check: the top-level config fields it reads, and what it does with them."""

    name: str
    fields: tuple[str, ...]
    run: Callable[[RunConfig], list[CheckResult]]


class StartupCheckError(RuntimeError):
    """A service cannot start; the message names every failed check."""

    def __init__(self, role: str, failures: list[CheckResult]):
        self.failures = failures
        lines = "\n".join(f"  {result.name}: {result.detail}" for result in failures)
        super().__init__(f"{role} start-up checks failed:\n{lines}")


def _short(error: BaseException, limit: int = 300) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def _with_deadline(work: Callable[[], None], timeout_s: float) -> None:
    """``work()`` in a daemon thread, given up after ``timeout_s`` (a hung socket cannot be cancelled, only abandoned)."""
    errors: list[Exception] = []

    def target() -> None:
        try:
            work()
        except Exception as error:  # raised again in the caller's thread
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True, name="doctor-probe")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g}s")
    if errors:
        raise errors[0]


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


def check_packages(lock: Path = LOCK_FILE) -> CheckResult:
    """Installed versions against the ``==`` pins of a pip-freeze lock, by public version (2.13.0 == 2.13.0+cpu)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

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


def _driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (no nvidia-smi)"
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({_short(error, 80)})"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def check_gpu() -> CheckResult:
    import torch

    if not torch.cuda.is_available():
        return CheckResult("gpu", "ok", f"no GPU (CPU run), torch {torch.__version__}")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    devices = f"{len(names)} × {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    detail = f"{devices}; torch {torch.__version__}, CUDA {torch.version.cuda}, driver {_driver_version()}"
    try:
        nccl = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError) as error:
        # One GPU trains without NCCL; more than one cannot share gradients.
        return CheckResult(
            "gpu", "warn" if len(names) == 1 else "fail", f"{detail}, NCCL unavailable: {_short(error, 120)}"
        )
    nccl_text = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return CheckResult("gpu", "ok", f"{detail}, NCCL {nccl_text}")


# Config checks.


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))


def check_model(path: Path, name: str = "model") -> CheckResult:
    """The folder loads as a Hugging Face causal LM would: config, a real tokenizer that fits the embeddings, weights."""
    from transformers import AutoConfig, AutoTokenizer

    if not path.is_dir():
        return CheckResult(name, "fail", f"{path}: no such folder")
    # transformers raises OSError, ValueError, KeyError... depending on what is wrong with the folder.
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as error:
        return CheckResult(name, "fail", f"{path}: config does not load: {_short(error)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as error:
        return CheckResult(name, "fail", f"{path}: tokenizer does not load: {_short(error)}")
    vocab = len(tokenizer)
    # Without tokenizer files transformers builds an empty tokenizer holding only special tokens.
    if vocab <= len(tokenizer.all_special_tokens):
        return CheckResult(
            name, "fail", f"{path}: the tokenizer is empty ({vocab} tokens): tokenizer files are missing"
        )
    embeddings = getattr(config, "vocab_size", None)
    if embeddings is not None and vocab > embeddings:
        return CheckResult(
            name, "fail", f"{path}: the tokenizer has {vocab} tokens but the model embeds only {embeddings}"
        )
    weights = _weight_files(path)
    if not weights:
        return CheckResult(name, "fail", f"{path}: no weights (*.safetensors or pytorch_model*.bin)")
    size = sum(p.stat().st_size for p in weights)
    return CheckResult(name, "ok", f"{path}: {config.model_type}, {vocab} tokens, weights {_size(size)}")


def check_dataset(path: Path, name: str, max_lines: int) -> CheckResult:
    """The first ``max_lines`` lines parse as rows; the bad ones are listed by line number."""
    bad: list[str] = []
    rows = checked = 0
    truncated = False
    try:
        with path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                if number > max_lines:
                    truncated = True
                    break
                checked = number
                if not raw.strip():
                    continue
                error = row_problem(raw)
                if error is None:
                    rows += 1
                else:
                    bad.append(f"line {number}: {error}")
    except OSError as error:
        return CheckResult(name, "fail", f"{path}: cannot read: {_short(error)}")
    scope = f"first {checked} lines" if truncated else f"{checked} lines"
    if bad:
        shown = "; ".join(bad[:SHOWN_BAD_LINES]) + (
            f"; and {len(bad) - SHOWN_BAD_LINES} more" if len(bad) > SHOWN_BAD_LINES else ""
        )
        return CheckResult(name, "fail", f"{path}: {len(bad)} bad of {scope}: {shown}")
    if rows == 0:
        return CheckResult(name, "fail", f"{path}: no rows")
    return CheckResult(name, "ok", f"{path}: {rows} rows parse ({scope} checked)")


def check_storage(url: str, checkpoint: CheckpointConfig, name: str = "storage") -> CheckResult:
    """Write, read back and delete a probe object under a prefix of its own."""
    from services.common.storage import open_store

    prefix = f".rlpipe-doctor-{uuid.uuid4().hex}/"
    payload = os.urandom(64)
    step = "open"

    def probe() -> None:
        nonlocal step
        store = open_store(url, checkpoint)
        step = "write"
        store.put(prefix + "probe", payload)
        step = "read"
        if store.get(prefix + "probe") != payload:
            raise OSError("read back other bytes than were written")
        step = "delete"
        store.delete_prefix(prefix)
        if store.list(prefix):
            raise OSError("the probe is still listed after delete")

    try:
        _with_deadline(probe, STORAGE_TIMEOUT_S)
    except Exception as error:  # file systems, S3 and the network fail in many types
        return CheckResult(name, "fail", f"{url}: {step} failed: {_short(error)}")
    return CheckResult(name, "ok", f"{url}: write, read and delete work")


def _storage_rows(cfg: RunConfig) -> list[CheckResult]:
    rows = [check_storage(cfg.checkpoint_url, cfg.checkpoint)]
    if cfg.checkpoint.mirror_url:
        rows.append(check_storage(cfg.checkpoint.mirror_url, cfg.checkpoint, "storage mirror"))
    return rows


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

    from services.common.bus import EDGES, Bus

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
            ),
            NETWORK_TIMEOUT_S,
        )
    except Exception as error:  # refused, unresolvable, timed out: all mean no broker
        cause = errors[-1] if errors else error
        hint = "a config for rlpipe run, which starts its own broker, is checked with --embedded"
        return [
            CheckResult("nats", "fail", f"cannot connect to {url}: {_short(cause)} ({hint})"),
            CheckResult("streams", "skip", "no broker to ask"),
        ]
    try:
        js = nc.jetstream(timeout=NETWORK_TIMEOUT_S)
        try:
            await js.account_info()
        except Exception as error:  # no responders, timeout or an API error: all mean no usable JetStream
            return [
                CheckResult("nats", "fail", f"{url}: JetStream is not enabled for this account: {_short(error)}"),
                CheckResult("streams", "skip", "no JetStream to ask"),
            ]
        nats_row = CheckResult("nats", "ok", f"{url}: nats-server {nc.connected_server_version}, JetStream enabled")
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
    from services.launcher import nats_server_binary

    streams = CheckResult("streams", "skip", "rlpipe run creates the embedded broker's streams")
    try:
        binary = nats_server_binary()
        out = subprocess.run([binary, "--version"], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as error:
        return [CheckResult("nats", "fail", f"rlpipe run cannot start its broker: {_short(error)}"), streams]
    if out.returncode != 0:
        return [
            CheckResult("nats", "fail", f"{binary} --version exited with {out.returncode}: {_short(out.stderr)}"),
            streams,
        ]
    return [
        CheckResult(
            "nats", "ok", f"rlpipe run starts its own broker, {out.stdout.strip()} ({binary}); nats.url is not used"
        ),
        streams,
    ]


def check_ports(host: str, ports: dict[str, int]) -> CheckResult:
    """Each fixed port can be bound on ``host``; 0 means any free port and is not probed."""
    fixed = {field: port for field, port in ports.items() if port}
    if not fixed:
        return CheckResult("ports", "skip", "every port is 0 (any free port)")
    busy = []
    for field, port in fixed.items():
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            with socket.socket(family, kind, proto) as sock:
                # As the servers do, so a port in TIME_WAIT counts as free.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
        except OSError as error:  # socket.gaierror included: an unresolvable host binds nothing
            busy.append(f"{field} {port} on {host}: {error.strerror or error}")
    if busy:
        return CheckResult("ports", "fail", "; ".join(busy))
    return CheckResult(
        "ports", "ok", f"free on {host}: " + ", ".join(f"{field}={port}" for field, port in fixed.items())
    )


def _role_ports(cfg: RunConfig, role: str) -> dict[str, int]:
    """The fixed ports ``role`` binds; ``run``: those its children bind that the launcher does not choose; ``doctor``: all."""
    ports = {"telemetry.metrics_port": cfg.telemetry.metrics_port}
    if role == "trainer":
        ports |= {"service.trainer_grpc_port": cfg.service.trainer_grpc_port, "admin.port": cfg.admin.port}
    elif role == "run":
        # The launcher picks free ports for WeightSync, and for admin unless the config names one.
        if "port" in cfg.admin.model_fields_set:
            ports |= {"admin.port": cfg.admin.port}
    elif role == "doctor":
        ports |= {
            "service.trainer_grpc_port": cfg.service.trainer_grpc_port,
            "service.grpc_port": cfg.service.grpc_port,
            "admin.port": cfg.admin.port,
        }
    else:
        ports |= {"service.grpc_port": cfg.service.grpc_port}
    return ports


def check_admin_token(cfg: RunConfig, launcher_generates: bool) -> CheckResult:
    """``launcher_generates``: started by ``rlpipe run``, which makes a token when none is set."""
    if AdminCredentials().token:
        return CheckResult("admin token", "ok", "set by RLPIPE_ADMIN_TOKEN")
    token_file = cfg.admin.token_file
    if token_file is None:
        missing = "neither RLPIPE_ADMIN_TOKEN nor admin.token_file is set"
    else:
        try:
            token = token_file.read_text().strip()
        except OSError as error:
            return CheckResult("admin token", "fail", f"admin.token_file {token_file}: {_short(error)}")
        if token:
            return CheckResult("admin token", "ok", f"read from admin.token_file {token_file}")
        missing = f"admin.token_file {token_file} is empty"
    if not launcher_generates:
        return CheckResult("admin token", "fail", f"{missing}: the trainer does not start without one")
    if cfg.environment == "prod":
        return CheckResult(
            "admin token", "fail", f"{missing}: a prod deployment must set its own, not rely on a generated one"
        )
    return CheckResult("admin token", "warn", f"{missing}: rlpipe run generates one into {cfg.run_dir / 'admin.token'}")


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_disk(cfg: RunConfig) -> CheckResult:
    """Free space where file:// checkpoints go, against keep_last + 1 of them (a new step lands before the oldest goes)."""
    targets = [url for url in (cfg.checkpoint_url, cfg.checkpoint.mirror_url) if url.startswith("file://")]
    if not targets:
        return CheckResult("disk", "skip", f"checkpoints go to {cfg.checkpoint_url}: free space is the object store's")
    weights = sum(p.stat().st_size for p in _weight_files(cfg.model.path))
    per_checkpoint = weights * CHECKPOINT_WEIGHT_FACTOR
    if cfg.train.algorithm == "ppo" and cfg.train.critic.kind == "separate":
        per_checkpoint *= 2  # the critic is a second backbone with its own moments
    count = cfg.checkpoint.keep_last + 1
    need = count * per_checkpoint
    free, enough = [], True
    for url in targets:
        where = _existing_ancestor(Path(unquote(urlparse(url).path)))
        available = shutil.disk_usage(where).free
        free.append(f"{_size(available)} free at {where}")
        enough = enough and available >= need
    detail = f"need about {_size(need)} ({count} checkpoints of ~{_size(per_checkpoint)}); " + ", ".join(free)
    return CheckResult("disk", "ok" if enough else "fail", detail)


def _model_rows(cfg: RunConfig, policy: bool, reference: bool) -> list[CheckResult]:
    rows = [check_model(cfg.model.path)] if policy else []
    if reference and (not policy or cfg.reference_model_path != cfg.model.path):
        rows.append(check_model(cfg.reference_model_path, "reference model"))
    return rows


def _dataset_rows(cfg: RunConfig, max_lines: int) -> list[CheckResult]:
    paths = {"dataset data.train_path": cfg.data.train_path, "dataset data.eval_path": cfg.data.eval_path}
    return [check_dataset(path, name, max_lines) for name, path in paths.items() if path is not None]


def _doctor_checks(embedded: bool) -> list[Check]:
    ports_of = "run" if embedded else "doctor"
    return [
        Check("model", ("model", "reference"), lambda cfg: _model_rows(cfg, policy=True, reference=True)),
        Check("dataset", ("data",), lambda cfg: _dataset_rows(cfg, DOCTOR_DATASET_LINES)),
        Check("storage", ("checkpoint",), _storage_rows),
        Check("nats", ("nats",), _embedded_broker_rows if embedded else _nats_rows),
        Check(
            "ports",
            ("service", "admin", "telemetry"),
            lambda cfg: [check_ports(cfg.service.host, _role_ports(cfg, ports_of))],
        ),
        Check("admin token", ("admin",), lambda cfg: [check_admin_token(cfg, launcher_generates=embedded)]),
        Check("disk", ("model", "checkpoint", "train"), lambda cfg: [check_disk(cfg)]),
    ]


def _startup_checks(role: str) -> list[Check]:
    ports = Check(
        "ports", ("service", "admin", "telemetry"), lambda cfg: [check_ports(cfg.service.host, _role_ports(cfg, role))]
    )
    policy = Check("model", ("model",), lambda cfg: _model_rows(cfg, policy=True, reference=False))
    dataset = Check("dataset", ("data",), lambda cfg: _dataset_rows(cfg, STARTUP_DATASET_LINES))
    storage = Check("storage", ("checkpoint",), _storage_rows)
    token = Check("admin token", ("admin",), lambda cfg: [check_admin_token(cfg, launcher_generates=role == "run")])
    if role == "trainer":
        return [policy, dataset, storage, token, ports]
    if role == "rollout":
        return [policy, ports]
    if role == "reference":
        return [
            Check("model", ("model", "reference"), lambda cfg: _model_rows(cfg, policy=False, reference=True)),
            ports,
        ]
    if role == "reward":
        return [ports]
    both = Check("model", ("model", "reference"), lambda cfg: _model_rows(cfg, policy=True, reference=True))
    return [both, dataset, storage, token, ports]


def _run(checks: list[Check], cfg: RunConfig | None, invalid: frozenset[str]) -> list[CheckResult]:
    results = []
    for check in checks:
        if cfg is None:
            results.append(CheckResult(check.name, "skip", "needs a loadable config"))
            continue
        broken = [field for field in check.fields if field in invalid]
        if broken:
            results.append(CheckResult(check.name, "skip", f"invalid config: {', '.join(broken)} (see config)"))
            continue
        results += check.run(cfg)
    return results


def run_checks(
    cfg: RunConfig | None, *, embedded: bool = False, invalid: frozenset[str] = frozenset()
) -> list[CheckResult]:
    """Every check: the machine's, then the config's (skipped where ``cfg`` is None or the fields they read are ``invalid``).

    ``embedded``: the config is for ``rlpipe run``, which starts its own broker and picks the
    trainer's port, so the nats-server binary is checked instead of ``nats.url``.
    Not for a running event loop: the NATS probe runs its own.
    """
    return [check_python(), check_packages(), check_gpu(), *_run(_doctor_checks(embedded), cfg, invalid)]


def startup_checks(cfg: RunConfig, role: str) -> list[CheckResult]:
    """The cheap checks ``role`` needs before it starts (no network wait beyond a few seconds, no broker).

    trainer: model, datasets, storage probe, admin token (required: it does not start without
    one), its ports; rollout: model, ports; reference: reference model, ports; reward: ports;
    run (the launcher): models, datasets, storage, admin token (a warning: it generates one,
    except in prod), admin and metrics ports. The broker is left out: the bus waits for it,
    and ``rlpipe run`` starts its own after these checks.
    Returns the rows (warnings included); raises StartupCheckError naming each failure.
    """
    if role not in STARTUP_ROLES:
        raise ValueError(f"unknown role {role!r}: one of {STARTUP_ROLES}")
    results = _run(_startup_checks(role), cfg, frozenset())
    failures = [result for result in results if result.failed]
    if failures:
        raise StartupCheckError(role, failures)
    return results


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
