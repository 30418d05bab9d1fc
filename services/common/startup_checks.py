"""Start-up checks: the cheap subset of ``rlpipe doctor`` a process runs before it loads anything heavy.

A bad model folder, dataset or unwritable store stops a service (or ``rlpipe run``) at
once, with every reason named, instead of minutes later. Each check reads the config and
returns rows of (name, status, detail); ``rlpipe doctor`` (services/cli/doctor/checks.py) runs these
and the machine and broker checks and prints them as a table. They live in ``common``
because every role and both CLIs use them, and ``common`` imports neither.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import ssl
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeGuard

from services.common.config import (
    AdminCredentials,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    RolloutConfig,
    RunConfig,
    TokenError,
    WeightSyncCredentials,
    read_token_file,
    token_problem,
)
from services.common.episodes.environments import box_available
from services.common.model.datasets import DatasetError, scan_dataset
from services.common.model.device import device_name
from services.common.observe.hardware import GpuFacts, gpu_facts, gpu_seen, release_numbers
from services.common.transport.model_source import local_model_path

Status = Literal["ok", "warn", "fail", "skip"]

# An S3 probe is four requests (bucket, put, get, delete); a dead endpoint must not stall start-up.
STORAGE_TIMEOUT_S = 5.0
STARTUP_DATASET_LINES = 1_000
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


def shorten(error: BaseException | str, limit: int = 300) -> str:
    """``error`` (an exception, or a program's error output) in at most ``limit`` characters."""
    text = error if isinstance(error, str) else str(error) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def human_size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def _with_deadline(work: Callable[[], None], timeout_s: float) -> None:
    """``work()`` in a daemon thread, given up after ``timeout_s``.

    A hung socket cannot be cancelled, only abandoned.
    """
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


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))


def check_model(path: Path, name: str = "model") -> CheckResult:
    """The folder loads as a Hugging Face causal LM would.

    That is: a config, a real tokenizer that fits the embeddings, and weights. Read without transformers' Auto
    classes where the folder allows it: they import torch and every model family's code, 5 to 7 CPU s that a
    launcher or `rlpipe doctor` would spend before anything starts. The config is its JSON; the tokenizer is
    counted by ``_vocabulary``.
    """
    if not path.is_dir():
        return CheckResult(name, "fail", f"{path}: no such folder")
    try:
        config = json.loads((path / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError(f"config.json holds a {type(config).__name__}, not an object")
    except (OSError, ValueError) as error:
        return CheckResult(name, "fail", f"{path}: config does not load: {shorten(error)}")
    # transformers raises OSError, ValueError, KeyError... depending on what is wrong with the folder.
    try:
        vocab, special = _vocabulary(path)
    except Exception as error:
        return CheckResult(name, "fail", f"{path}: tokenizer does not load: {shorten(error)}")
    # Without tokenizer files transformers builds an empty tokenizer holding only special tokens.
    if vocab <= special:
        return CheckResult(
            name, "fail", f"{path}: the tokenizer is empty ({vocab} tokens): tokenizer files are missing"
        )
    embeddings = config.get("vocab_size")
    if embeddings is not None and vocab > embeddings:
        return CheckResult(
            name, "fail", f"{path}: the tokenizer has {vocab} tokens but the model embeds only {embeddings}"
        )
    weights = weight_files(path)
    if not weights:
        return CheckResult(name, "fail", f"{path}: no weights (*.safetensors or pytorch_model*.bin)")
    size = sum(p.stat().st_size for p in weights)
    kind = config.get("model_type", "unknown type")
    return CheckResult(name, "ok", f"{path}: {kind}, {vocab} tokens, weights {human_size(size)}")


def _vocabulary(path: Path) -> tuple[int, int]:
    """The tokenizer's size and how many of its tokens are special. A tokenizer.json is read by the tokenizers
    library alone (0.05 CPU s, against 2 for transformers' fast tokenizer class, which wraps the same object and
    counts it the same way); a folder without one goes through AutoTokenizer."""
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        special = sum(token.special for token in tokenizer.get_added_tokens_decoder().values())
        return tokenizer.get_vocab_size(with_added_tokens=True), special
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(path))
    return len(auto), len(auto.all_special_tokens)


def check_dataset(data: DataConfig, path: Path, split: str, name: str, max_rows: int) -> CheckResult:
    """The first ``max_rows`` rows (lines of a JSON Lines file) are prompt/answer rows; bad ones are listed by line
    number or row index."""
    try:
        # Streamed: a check reads the rows it checks, not the whole dataset.
        scan = scan_dataset(path, data.columns, split, max_rows, streaming=True)
    except OSError as error:
        return CheckResult(name, "fail", f"{path}: cannot read: {shorten(error)}")
    except Exception as error:  # a bad format, split or column, or whatever datasets or pyarrow could not read
        return CheckResult(name, "fail", shorten(error) if isinstance(error, DatasetError) else f"{path}: {error}")
    if scan.bad:
        return CheckResult(name, "fail", scan.summary(path))
    if scan.rows == 0:
        return CheckResult(name, "fail", f"{path}: no rows")
    scope = f"first {scan.checked} {scan.where}s" if scan.truncated else f"{scan.checked} {scan.where}s"
    return CheckResult(name, "ok", f"{path}: {scan.rows} rows parse ({scope} checked)")


def check_storage(url: str, checkpoint: CheckpointConfig, name: str = "storage", resume: bool = False) -> CheckResult:
    """Write, read back and delete a probe object under a prefix of its own.

    A store that refuses this configuration (``store_refusal``: credentials, a policy, TLS, a path that cannot hold
    a store) fails, naming what to fix. One that is only out of reach fails a fresh start (an endpoint that never
    answered is most likely wrong) but only warns a ``resume``: a store that held the run is down for now, and the
    resume waits for it (``checkpoint.resume_wait_s``, ``resume_waiting`` events) rather than refusing to start,
    which would end the run where an outage should only hold it."""
    from services.common.transport.storage import open_store

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
        failed = f"{url}: {step} failed: {shorten(error)}"
        refused = store_refusal(error, url)
        if refused:
            return CheckResult(name, "fail", f"{failed}; {refused}")
        if resume:
            return CheckResult(
                name,
                "warn",
                f"{failed}; out of reach, not refusing: the resume waits for it (checkpoint.resume_wait_s)",
            )
        return CheckResult(name, "fail", f"{failed}; never reached at a fresh start: check {_where(url)}")
    return CheckResult(name, "ok", f"{url}: write, read and delete work")


# S3 error codes that refuse the caller rather than say the store is down.
S3_REFUSING_CODES = frozenset(
    {"AccessDenied", "AllAccessDisabled", "ExpiredToken", "InvalidAccessKeyId", "InvalidToken", "SignatureDoesNotMatch"}
)
# File-system errors of a store that is away for now (a network mount that went stale, a device error), not one
# whose path cannot hold a store.
OUTAGE_ERRNOS = frozenset(
    {errno.EIO, errno.ESTALE, errno.ENOTCONN, errno.ETIMEDOUT, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETUNREACH}
)


def _where(url: str) -> str:
    return "checkpoint.s3_endpoint and the bucket" if url.startswith("s3://") else f"that {url} is mounted"


def store_refusal(error: BaseException, url: str) -> str:
    """What to fix when ``error`` (or what caused it) is the store refusing this configuration; "" when it is an
    outage (no connection, no answer in time, a 5xx, a name that does not resolve now, a stale mount), which waiting
    may end. A name that does not resolve counts as an outage: compose's DNS forgets a stopped container's name."""
    seen: BaseException | None = error
    for _ in range(8):  # the SDK's retry error, its reason, the socket's error
        if seen is None:
            return ""
        code = getattr(seen, "code", None)
        status = getattr(getattr(seen, "response", None), "status", None) or getattr(seen, "status_code", None)
        if (isinstance(code, str) and code in S3_REFUSING_CODES) or status in (401, 403):
            return (
                "the store refuses these credentials: check RLPIPE_S3_ACCESS_KEY and RLPIPE_S3_SECRET_KEY, and the "
                f"bucket's policy for them ({code or status})"
            )
        if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):  # those two: busy, for now
            return f"the endpoint answers {status}: is checkpoint.s3_endpoint an S3 endpoint?"
        if isinstance(seen, ssl.SSLError):
            return "TLS with the endpoint failed: check checkpoint.s3_secure and the endpoint's certificate"
        if url.startswith("file://") and _path_refused(seen):
            name = errno.errorcode.get(seen.errno or 0, str(seen.errno))
            return f"checkpoint.store_url cannot hold a store here ({name}): fix the folder or its permissions"
        if isinstance(seen, ValueError):
            return f"the store's configuration is refused: {shorten(seen)}"
        reason = getattr(seen, "reason", None)
        seen = reason if isinstance(reason, BaseException) else seen.__cause__ or seen.__context__
    return ""


def _path_refused(error: BaseException) -> TypeGuard[OSError]:
    """A file-system error that says the path cannot hold a store (permissions, a read-only file system, a file in
    the way), not that the store behind it is away for now."""
    if not isinstance(error, OSError) or isinstance(error, (TimeoutError, ConnectionError)):
        return False
    return error.errno is not None and error.errno not in OUTAGE_ERRNOS


def storage_rows(cfg: RunConfig, resume: bool = False) -> list[CheckResult]:
    rows = [check_storage(cfg.checkpoint_url, cfg.checkpoint, resume=resume)]
    if cfg.checkpoint.mirror_url:
        rows.append(check_storage(cfg.checkpoint.mirror_url, cfg.checkpoint, "storage mirror", resume=resume))
    return rows


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


def role_ports(cfg: RunConfig, role: str) -> dict[str, int]:
    """The fixed ports ``role`` binds.

    ``run``: those its children bind that the launcher does not choose; ``doctor``: all of them.
    """
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
    """``launcher_generates``: started by ``rlpipe run``, which makes a token when none is set. A token that
    cannot go into a request's metadata (a line break, non-ASCII) fails, named by where it came from, never
    quoted."""
    if token := AdminCredentials().token:
        problem = token_problem(token)
        if problem is not None:
            return CheckResult("admin token", "fail", f"RLPIPE_ADMIN_TOKEN {problem}")
        return CheckResult("admin token", "ok", "set by RLPIPE_ADMIN_TOKEN")
    token_file = cfg.admin.token_file
    if token_file is None:
        missing = "neither RLPIPE_ADMIN_TOKEN nor admin.token_file is set"
    else:
        try:
            read_token_file(token_file, "admin.token_file")
            return CheckResult("admin token", "ok", f"read from admin.token_file {token_file}")
        except TokenError as error:
            if not error.empty:
                return CheckResult("admin token", "fail", str(error))
        missing = f"admin.token_file {token_file} is empty"
    if not launcher_generates:
        return CheckResult("admin token", "fail", f"{missing}: the trainer does not start without one")
    if cfg.environment == "prod":
        return CheckResult(
            "admin token", "fail", f"{missing}: a prod deployment must set its own, not rely on a generated one"
        )
    return CheckResult("admin token", "warn", f"{missing}: rlpipe run generates one into {cfg.run_dir / 'admin.token'}")


def check_python_box(rollout: RolloutConfig, probe_box: Callable[[], str | None] = box_available) -> list[CheckResult]:
    """With ``rollout.environment: python``: can this machine build the box model-written code runs in? No row for
    another environment. Without a box, a failure (``required``) or a warning (``allow_unisolated``)."""
    if rollout.environment != "python":
        return []
    name = "python tool box"
    reason = probe_box()
    if reason is None:
        return [CheckResult(name, "ok", "model-written code runs in new user, PID, network and mount namespaces")]
    if rollout.python_tool_isolation == "allow_unisolated":
        detail = f"no box here ({reason}): model-written code runs unboxed, as rollout.python_tool_isolation allows"
        return [CheckResult(name, "warn", detail)]
    return [
        CheckResult(
            name,
            "fail",
            f"no box for model-written code can be built here: {reason}; allow user namespaces, or set "
            "rollout.python_tool_isolation: allow_unisolated to run it unboxed",
        )
    ]


def check_weight_sync_token() -> CheckResult:
    """RLPIPE_WEIGHTSYNC_TOKEN, when set, can go into a call's metadata (gRPC would refuse every call otherwise)."""
    token = WeightSyncCredentials().token
    problem = token_problem(token) if token else None
    if problem is not None:
        return CheckResult("weight-sync token", "fail", f"RLPIPE_WEIGHTSYNC_TOKEN {problem}")
    return CheckResult("weight-sync token", "ok", "set" if token else "not set (rlpipe run generates one)")


def cuda_failure(facts: GpuFacts) -> str:
    """Why CUDA does not initialize on a machine that has a GPU, with what to do about it."""
    if facts.torch_cuda is None:
        return (
            f"torch {facts.torch_version} is a CPU-only build (torch.version.cuda is None); "
            "install a CUDA build of torch (deploy/requirements-cuda.txt)"
        )
    if facts.driver_cuda is not None and release_numbers(facts.driver_cuda)[:1] < release_numbers(facts.torch_cuda)[:1]:
        return (
            f"torch {facts.torch_version} is built for CUDA {facts.torch_cuda} but driver "
            f"{facts.driver_version or '(version unknown)'} supports CUDA up to {facts.driver_cuda}; "
            "upgrade the driver or install a torch built for the driver's CUDA"
        )
    if facts.cuda_error:
        return f"torch.cuda.init() raised {facts.cuda_error}"
    return "torch.cuda.is_available() is False and torch.cuda.init() raised nothing"


def device_result(name: str, cuda_available: bool, broken_gpu: GpuFacts | None) -> CheckResult:
    """``model.device`` against what this process has.

    ``broken_gpu``: the facts of a GPU that is present but that CUDA cannot open (None when there
    is none, or CUDA works). With it, ``auto`` fails instead of quietly training on the CPU.
    """
    broken = (
        f"a GPU is present ({broken_gpu.gpu_seen}) but CUDA does not initialize: {cuda_failure(broken_gpu)}"
        if broken_gpu is not None
        else ""
    )
    try:
        device = device_name(name, cuda_available)
    except ConfigError as error:
        detail = str(error).removeprefix("invalid configuration:").strip()
        return CheckResult("device", "fail", f"{detail}; {broken}" if broken else detail)
    if broken and name == "auto":
        return CheckResult(
            "device", "fail", f"model.device auto would run on the CPU: {broken}; or set model.device cpu on purpose"
        )
    return CheckResult("device", "ok", f"model.device {name}: {device}")


def check_device(cfg: RunConfig) -> CheckResult:
    """``model.device`` names a device this process has (``cuda`` with no GPU is refused here, not mid-load).

    CUDA needs a GPU that the driver shows, so torch (seconds of CPU to import) is asked only where ``gpu_seen``
    finds one: a stat of /proc first, at worst nvidia-smi and NVML.
    """
    if not gpu_seen():
        return device_result(cfg.model.device, cuda_available=False, broken_gpu=None)
    import torch

    available = torch.cuda.is_available()
    broken = gpu_facts() if not available and cfg.model.device != "cpu" else None
    return device_result(cfg.model.device, available, broken)


def model_rows(cfg: RunConfig, policy: bool, reference: bool) -> list[CheckResult]:
    """The policy's (and the reference's) model folder as ``check_model`` sees it. A model.path URL is checked
    where it was fetched to; one not fetched yet gets a warning (the roles fetch it at start: resolve_model)."""
    local = local_model_path(cfg)
    if local is None:
        policy_row = CheckResult(
            "model",
            "warn",
            f"{cfg.model.path}: not fetched yet; the first start fetches it into {cfg.model.fetch.cache_dir}",
        )
    else:
        policy_row = check_model(local)
    rows = [policy_row] if policy else []
    if reference and cfg.reference.model_path is not None and (not policy or cfg.reference.model_path != local):
        rows.append(check_model(cfg.reference.model_path, "reference model"))
    elif reference and not policy:
        rows.append(CheckResult("reference model", policy_row.status, policy_row.detail))
    return rows


def dataset_rows(cfg: RunConfig, max_lines: int) -> list[CheckResult]:
    sources = {
        "dataset data.train_path": (cfg.data.train_path, cfg.data.split),
        "dataset data.eval_path": (cfg.data.eval_path, cfg.data.eval_split),
    }
    return [check_dataset(cfg.data, path, split, name, max_lines) for name, (path, split) in sources.items() if path]


def _startup_checks(role: str, resume: bool = False) -> list[Check]:
    ports = Check(
        "ports", ("service", "admin", "telemetry"), lambda cfg: [check_ports(cfg.service.host, role_ports(cfg, role))]
    )
    policy = Check("model", ("model",), lambda cfg: model_rows(cfg, policy=True, reference=False))
    dataset = Check("dataset", ("data",), lambda cfg: dataset_rows(cfg, STARTUP_DATASET_LINES))
    storage = Check("storage", ("checkpoint",), lambda cfg: storage_rows(cfg, resume))
    token = Check("admin token", ("admin",), lambda cfg: [check_admin_token(cfg, launcher_generates=role == "run")])
    device = Check("device", ("model",), lambda cfg: [check_device(cfg)])
    # The rollout plays episodes, the trainer its held-out ones: both run the Python tool.
    box = Check("python tool box", ("rollout",), lambda cfg: check_python_box(cfg.rollout))
    weight_sync = Check("weight-sync token", (), lambda cfg: [check_weight_sync_token()])
    if role == "trainer":
        return [policy, device, dataset, storage, token, weight_sync, box, ports]
    if role == "rollout":
        return [policy, weight_sync, box, ports]
    if role == "reference":
        return [
            Check("model", ("model", "reference"), lambda cfg: model_rows(cfg, policy=False, reference=True)),
            device,
            ports,
        ]
    if role == "reward":
        return [ports]
    both = Check("model", ("model", "reference"), lambda cfg: model_rows(cfg, policy=True, reference=True))
    return [both, device, dataset, storage, token, weight_sync, box, ports]


def run_each(checks: list[Check], cfg: RunConfig | None, invalid: frozenset[str]) -> list[CheckResult]:
    """Each check's rows; a check is skipped, with a row saying why, without a config or with a field of it invalid."""
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


def startup_checks(cfg: RunConfig, role: str, resume: bool = False) -> list[CheckResult]:
    """The cheap checks ``role`` needs before it starts (no network wait beyond a few seconds, no broker).

    trainer: model, datasets, storage probe, admin token (required: it does not start without
    one), weight-sync token (sendable when set), the Python tool's box (with ``rollout.environment: python``), its
    ports; rollout: model, weight-sync token, the box, ports; reference: reference model, ports; reward: ports; run
    (the launcher): models, datasets, storage, admin token (a warning: it generates one, except in prod),
    weight-sync token, the box, admin and metrics ports. The broker is left out: the bus waits for it, and
    ``rlpipe run`` starts its own after these checks.
    ``resume``: the run goes on from its checkpoints (a restart, ``rlpipe run --resume``), so a store out of reach
    is an outage the resume waits out, not a refusal (``check_storage``).
    Returns the rows (warnings included); raises StartupCheckError naming each failure.
    """
    if role not in STARTUP_ROLES:
        raise ValueError(f"unknown role {role!r}: one of {STARTUP_ROLES}")
    results = run_each(_startup_checks(role, resume), cfg, frozenset())
    failures = [result for result in results if result.failed]
    if failures:
        raise StartupCheckError(role, failures)
    return results
