"""Real servers for the tests: nats-server with JetStream, moto_server as the S3 endpoint, and the tiny model."""

from __future__ import annotations

import _posixsubprocess
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.observe.metrics import check_row
from services.common.observe.records import MetricsRow, read_metrics

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TEST_MODEL_DIR = ROOT / "build" / "test-model"

# Every test belongs to exactly one tier (pyproject.toml describes them). A module's `pytestmark` sets the tier of
# its tests; a test that differs carries its own marker, and the marker closest to the test wins.
TIERS = ("unit", "integration", "e2e")
MODEL_BUILDS = {"tiny_model", "tiny_reward_model"}  # session fixtures that train a model: never in the unit tier

# vLLM's sampler compiles two small helpers with torch.compile on its first batch (the per-token logprob ranks; the
# model itself runs eager, enforce_eager). On the CPU backend that is an inductor C++ build in every rollout process:
# about 3 CPU s and 7 to 40 s of wall time before the first group of every run on this machine, for kernels that a
# 3-layer model does not need. rlpipe itself compiles nothing, so the tests and every process they start (which
# inherits this environment) run those helpers eagerly: the same results, without the build.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    # The recovery simulation (tests/trainer/test_simulation.py, docs/testing.md): replay one seed, or run more.
    group = parser.getgroup("rlpipe simulation")
    group.addoption("--sim-seed", type=int, default=None, help="run only this seed of the recovery simulation")
    group.addoption("--sim-scenarios", type=int, default=1000, help="how many seeded scenarios to run (long mode)")


def tier_of(item: pytest.Item) -> str | None:
    return next((marker.name for marker in item.iter_markers() if marker.name in TIERS), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = [item.nodeid for item in items if tier_of(item) is None]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker ({', '.join(TIERS)}): {', '.join(untiered[:10])}")
    # Caught here, before a session fixture would build the model (tens of seconds on a fresh clone) for them.
    building = [item.nodeid for item in items if tier_of(item) == "unit" and MODEL_BUILDS & set(item.fixturenames)]
    if building:
        raise pytest.UsageError(
            f"unit tests that build a model ({', '.join(sorted(MODEL_BUILDS))}): {', '.join(building[:10])}; "
            "mark them integration, or give them a folder the config loader accepts (config_only_model)"
        )
    # `-m unit` selects by any marker on the way up; keep only the tests whose own tier was asked for (one tier, or
    # several joined by "or").
    asked = {name.strip() for name in config.getoption("markexpr").split(" or ")}
    if asked <= set(TIERS):
        config.hook.pytest_deselected(items=[item for item in items if tier_of(item) not in asked])
        items[:] = [item for item in items if tier_of(item) in asked]
    items.sort(key=scheduling_rank)


# The files that take longest, longest first (wall seconds on 3 workers measured at stop 31, docs/testing.md; the
# SmolLM2 file imports its model on a fresh clone). pytest-xdist hands out whole files (--dist loadfile) in collection
# order (--no-loadscope-reorder): the longest started first leave short files to fill the end, where a long one last
# would run on one core while the others idle. The unit tier's own longest file (30 to 43 s, a thousand simulated
# scenarios) leads the unit session for the same reason; the other tiers deselect it.
LONGEST_FIRST = (
    "tests/trainer/test_simulation.py",
    "tests/trainer/test_algorithms_pipeline.py",
    "tests/cli/verify/test_checklist.py",
    "tests/trainer/learning/test_distributed.py",
    "tests/test_storage_outage.py",
    "tests/test_exactly_once.py",
    "tests/test_chaos.py",
    "tests/test_admin.py",
    "tests/tuner/test_shared_study.py",
    "tests/rollout/test_smol_sync.py",
    "tests/tuner/test_tune.py",
    "tests/trainer/learning/test_learner.py",
    "tests/common/test_datasets.py",
    "tests/cli/doctor/test_checks.py",
    "tests/test_pipeline.py",
    "tests/cli/launch/test_launcher.py",
    "tests/test_overrides.py",
    "tests/trainer/learning/test_distributed_launch.py",
    "tests/reward/test_reward_pipeline.py",
    "tests/test_recovery.py",
)
# Files that mostly wait (on timeouts, breakers, stopped processes: under a fifth of their wall time on a core),
# handed out next, while the other workers' runs keep both cores busy. Last in the queue, as at stop 30, they were
# the last five minutes, and the cores idled for two minutes of them.
WAITING = (
    "tests/test_stalls.py",
    "tests/common/test_bus_faults.py",
    "tests/reward/test_remote.py",
    "tests/rollout/test_torn_sync.py",
    "tests/trainer/test_trainer_health.py",
    "tests/common/test_nats_auth.py",
    "tests/rollout/test_engine_outage.py",
    "tests/reward/test_service.py",
    "tests/common/test_presence.py",
)


def scheduling_rank(item: pytest.Item) -> tuple[int, int]:
    """Where ``item``'s file goes in the run: the listed longest files first, then the files that mostly wait, then
    the other files by tier, whole runs (e2e) first and the in-process unit files last, where they fill the cores
    while the last long files finish; a stable sort keeps each file's tests in their order."""
    path = item.nodeid.partition("::")[0]
    if path in LONGEST_FIRST:
        return (0, LONGEST_FIRST.index(path))
    if path in WAITING:
        return (1, WAITING.index(path))
    return (2, ("e2e", "integration", "unit").index(tier_of(item)))


class UnitTierViolation(RuntimeError):
    """A test marked `unit` reached for a socket or a process: it belongs to the integration tier."""


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit tier's promise, enforced: no network connection, no listening socket, no child process."""
    if tier_of(request.node) != "unit":
        return

    def refuse(what: str):
        def refused(*args, **kwargs):
            raise UnitTierViolation(f"{request.node.nodeid} is marked unit but {what}; mark it integration")

        return refused

    monkeypatch.setattr(socket.socket, "connect", refuse("opened a network connection"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("opened a network connection"))
    monkeypatch.setattr(socket.socket, "listen", refuse("listened on a socket"))
    # subprocess and multiprocessing both start children through fork_exec (subprocess under a name of its own).
    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse("started a process"))
    monkeypatch.setattr(subprocess, "_fork_exec", refuse("started a process"))  # subprocess's own name for it
    monkeypatch.setattr(os, "fork", refuse("forked a process"))
    monkeypatch.setattr(os, "posix_spawn", refuse("started a process"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout}s")


def start_nats(store: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    process = subprocess.Popen(
        [str(BIN / "nats-server"), "-js", "-sd", str(store), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port, process, "nats-server")
    return process, f"nats://127.0.0.1:{port}"


@contextlib.contextmanager
def keyed_nats(folder: Path, run_id: str = "test") -> Iterator[tuple[str, dict]]:
    """A broker with the run's per-role keys, started as the launcher starts it: (its URL, each role's key)."""
    from services.common.transport.nats_auth import server_authorization, write_run_credentials
    from services.common.transport.nats_server import embedded_config, nats_server_binary

    keys = write_run_credentials(folder / "nats-auth")
    port = free_port()
    conf = folder / "nats.conf"
    conf.write_text(embedded_config(port, folder / "store", False, server_authorization(run_id, list(keys.values()))))
    server = subprocess.Popen(
        [nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_port(port, server, "nats-server")
        yield f"nats://127.0.0.1:{port}", keys
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    """A fresh JetStream server per test, so streams never leak between tests."""
    process, url = start_nats(tmp_path / "nats")
    yield url
    process.terminate()
    process.wait(timeout=10)


async def create_run_state(cfg) -> None:
    """The run's streams and buckets, as the trainer creates them at start: a stage only waits for them."""
    from services.common.transport.bus import Bus
    from services.common.transport.live_config import LiveConfig
    from services.common.transport.presence import open_bucket

    bus = await Bus(cfg, "trainer").connect()
    await LiveConfig(cfg, bus.js).start()
    await open_bucket(bus.js, cfg.run_id, cfg.nats)
    await bus.close()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port, process, "moto_server")
    yield f"127.0.0.1:{port}"
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("RLPIPE_S3_ACCESS_KEY", "testing")
    monkeypatch.setenv("RLPIPE_S3_SECRET_KEY", "testing")
    return s3_endpoint


# The runs a test worker starts over the tiny model fork their roles from one warm-start pool of that worker
# (service.warm_start_pool, docs/testing.md), which imports torch, transformers and vLLM once rather than once per
# run (about 10 CPU s a run). write_config names it in every config it writes while it runs.
WARM_POOL: list[Path] = []


@contextlib.contextmanager
def running_warm_pool(modules: list[str], log_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`python -m services.cli.launch.warm_start --listen SOCKET MODULES...` from the repository root, yielding its
    process
    and socket once it listens (it imports after, and a launcher joining meanwhile waits for them); killed after.
    The socket is in a short temporary folder: its path must fit in 108 bytes, which a deep --basetemp may not."""
    from services.common.parent_death import die_with_parent

    socket_path = Path(tempfile.mkdtemp(prefix="rlpipe-pool-")) / "pool.sock"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli.launch.warm_start", "--listen", str(socket_path), *modules],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    try:
        deadline = time.monotonic() + 60
        while not socket_path.exists():
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        yield process, socket_path
    finally:
        process.kill()
        process.wait()
        shutil.rmtree(socket_path.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def warm_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This worker's warm-start pool: its socket, once the pool listens."""
    from services.cli.launch.warm_start import preload_modules

    log_path = tmp_path_factory.mktemp("warm-pool") / "pool.log"
    with running_warm_pool(preload_modules(vllm_rollout=True), log_path) as (_, socket_path):
        WARM_POOL.append(socket_path)
        yield socket_path
        WARM_POOL.remove(socket_path)


@pytest.fixture(scope="session")
def tiny_model(warm_pool: Path) -> tuple[Path, Path]:
    """The project's own tiny model and data, built once (reused while its build settings match); the runs over it
    fork from this worker's warm-start pool."""
    from services.cli.build.tiny_model import main as build

    model_dir, data_dir = TEST_MODEL_DIR / "model", TEST_MODEL_DIR / "data"
    with one_builder("tiny-model"):
        build(["--out", str(model_dir), "--data", str(data_dir), "--seed", "0"])
    return model_dir, data_dir


@pytest.fixture
def config_only_model(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder and data files the config loader accepts, for a test that only reads a config: nothing to
    load or build (the unit tier may not build the tiny model)."""
    model_dir, data_dir = tmp_path / "config-only-model", tmp_path / "config-only-data"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    data_dir.mkdir()
    for split in ("train", "eval"):
        (data_dir / f"{split}.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return model_dir, data_dir


@contextlib.contextmanager
def one_builder(name: str) -> Iterator[None]:
    """Held while a shared test artefact under build/test-model is built or checked: pytest-xdist workers each ask
    for it, so one builds (or rewrites its data files) while the others wait, then reuse it."""
    TEST_MODEL_DIR.mkdir(parents=True, exist_ok=True)
    with open(TEST_MODEL_DIR / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_config(path: Path, model_dir: Path, data_dir: Path, runs_dir: Path, **sections: dict) -> Path:
    """A small run config for tests; ``sections`` update the defaults section by section."""
    import yaml

    config = {
        "run_id": "test",
        "runs_dir": str(runs_dir),
        "model": {"path": str(model_dir)},
        "data": {
            "train_path": str(data_dir / "train.jsonl"),
            "eval_path": str(data_dir / "eval.jsonl"),
            "eval_every_steps": 0,
            "eval_size": 100,
        },
        "sampling": {"group_size": 4, "max_new_tokens": 6},
        "train": {
            "total_steps": 4,
            "batch_size": 8,
            "learning_rate": 1e-3,
            "max_seq_len": 32,
            "max_inflight_batches": 2,
        },
        "checkpoint": {"save_every_steps": 2, "keep_last": 2},
        "nats": {"ack_wait_s": 30, "max_deliver": 3, "duplicate_window_s": 600, "fetch_timeout_s": 0.5},
        "rollout": {"prompts_per_batch": 16},
    }
    if WARM_POOL:
        config["service"] = {"warm_start_pool": str(WARM_POOL[0])}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values} if isinstance(values, dict) else values
    path.write_text(yaml.safe_dump(config))
    return path


RLPIPE = [sys.executable, "-m", "services.cli"]
RLPIPE_RUN = [*RLPIPE, "run"]


def metric_rows(run_dir: Path) -> list[MetricsRow]:
    """The run's metrics rows, typed; each is checked against the metrics contract (services/common/observe/
    metrics.py), so every test that reads a real run's rows fails when the trainer writes an undeclared key."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    for row in rows:
        check_row(row.raw)
    return rows


def service_events(run_dir: Path, service: str) -> list[dict]:
    """The JSON log events of ``service`` (e.g. "trainer") in a run, oldest first; none before its log exists."""
    log_file = run_dir / "logs" / f"{service}.log"
    if not log_file.exists():
        return []
    return [json.loads(line) for line in log_file.read_text().splitlines() if line.startswith("{")]


def wait_for(condition, what: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def run_info(run_dir: Path, process: subprocess.Popen, timeout: float = 300) -> dict:
    """``runs/<run>/run.json`` once it is there: the launcher writes it when it has seen every service ready, which
    can come after the first steps (a role may work before the launcher has read its presence entry)."""
    path = run_dir / "run.json"
    wait_for(path.is_file, "run.json (every service ready)", process, timeout)
    return json.loads(path.read_text())


def kill_service(run_dir: Path, name: str, process: subprocess.Popen) -> int:
    """SIGKILL the service ``name`` (or "nats") of the run ``process`` launched; its pid."""
    pid = run_info(run_dir, process)["pids"][name]
    os.kill(pid, signal.SIGKILL)
    return pid


def rlpipe(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """An operator's `rlpipe --run-dir RUN_DIR ARGS...`, with the address and token of that run."""
    env = {k: v for k, v in os.environ.items() if k != "RLPIPE_ADMIN_TOKEN"}  # the token comes from the run directory
    return subprocess.run(
        [*RLPIPE, "--run-dir", str(run_dir), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@contextlib.contextmanager
def running_pipeline(config: Path, *options: str) -> Iterator[subprocess.Popen]:
    """`rlpipe run CONFIG [OPTIONS]` in the background (output in .stdout); killed if the test leaves it running."""
    process = subprocess.Popen(
        [*RLPIPE_RUN, str(config), *options], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def run_pipeline(config: Path, timeout: float = 600) -> tuple[subprocess.CompletedProcess, list[MetricsRow]]:
    """`rlpipe run CONFIG` as a user runs it; returns the finished process and the run's metric rows (checked
    against the metrics contract: ``metric_rows``)."""
    import yaml

    done = subprocess.run([*RLPIPE_RUN, str(config)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    cfg = yaml.safe_load(config.read_text())
    return done, metric_rows(Path(cfg["runs_dir"]) / cfg["run_id"])


class StoppableS3:
    """A moto_server that a test stops and starts again on the same port (it comes back empty)."""

    def __init__(self):
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, self.process, "moto_server")

    def stop(self) -> None:
        self.process.kill()  # a no-op on one already stopped
        self.process.wait()

    def checkpoint(self, **settings) -> dict:
        """The run config's checkpoint section for this endpoint."""
        return {
            "store_url": "s3://ckpt/prefix",
            "s3_endpoint": f"127.0.0.1:{self.port}",
            "s3_secure": False,
            **settings,
        }


@pytest.fixture
def s3(monkeypatch):
    monkeypatch.setenv("RLPIPE_S3_ACCESS_KEY", "testing")
    monkeypatch.setenv("RLPIPE_S3_SECRET_KEY", "testing")
    endpoint = StoppableS3()
    yield endpoint
    endpoint.stop()
