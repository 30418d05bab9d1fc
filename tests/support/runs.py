"""Run configs and whole runs: ``write_config`` and its one-line forms, ``rlpipe run`` in the foreground or the
background, an operator's ``rlpipe`` commands, and the run's metrics rows, log events and ``run.json``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from services.common.observe.metrics import check_row
from services.common.observe.records import MetricsRow, read_metrics
from tests.support.paths import ROOT
from tests.support.servers import free_port

# The runs a test worker starts over the tiny model fork their roles from one warm-start pool of that worker
# (service.warm_start_pool, docs/testing.md), which imports torch, transformers and vLLM once rather than once per
# run (about 10 CPU s a run). write_config names it in every config it writes while it runs; the warm_pool fixture
# (tests.support.fixtures) puts its socket here.
WARM_POOL: list[Path] = []

RLPIPE = [sys.executable, "-m", "services.cli"]
RLPIPE_RUN = [*RLPIPE, "run"]
# Real runs whose subject is not generation: transformers' generate starts and stops faster than vLLM, and a busy
# machine gets more time to stop the services.
LIGHT_RUN = {"rollout": {"backend": "hf", "prompts_per_batch": 16}, "supervision": {"stop_grace_s": 60}}
# NATS settings under which a delivery nobody settles comes back within a second and a message goes to DEAD after
# its second delivery: tests of redelivery and dead letters would otherwise wait 30 s a delivery.
QUICK_REDELIVERY = {"ack_wait_s": 1, "heartbeat_s": 0.3, "max_deliver": 2, "fetch_timeout_s": 0.3}


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


def config_file(folder: Path, model_and_data: tuple[Path, Path], name: str = "c.yaml", /, **sections) -> Path:
    """``write_config`` as most tests call it: the file ``folder/name`` over a model folder and its data folder (as
    the ``tiny_model`` and ``config_only_model`` fixtures give them), the runs under ``folder/runs``. The first three
    are positional only, so that every keyword is a section (``model={...}`` included)."""
    model_dir, data_dir = model_and_data
    return write_config(folder / name, model_dir, data_dir, folder / "runs", **sections)


def run_config(folder: Path, model_and_data: tuple[Path, Path], name: str = "c.yaml", /, **sections):
    """The ``RunConfig`` of ``config_file(folder, model_and_data, name, **sections)``, loaded and validated."""
    from services.common.config import load_config

    return load_config(config_file(folder, model_and_data, name, **sections))


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
    # The tokens come from the run directory (admin.token, or admin-read.token with --read-only).
    env = {k: v for k, v in os.environ.items() if k not in ("RLPIPE_ADMIN_TOKEN", "RLPIPE_ADMIN_READ_TOKEN")}
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


def rlpipe_command(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`rlpipe ARGS...` as a user runs it from the repository root, its output captured."""
    return subprocess.run([*RLPIPE, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def doctor(config: Path, *args: str) -> subprocess.CompletedProcess:
    """`rlpipe doctor` as a user runs it; a wide terminal so table rows stay on one line."""
    return subprocess.run(
        [*RLPIPE, "doctor", "--config", str(config), *args],
        check=False,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=180,
    )


def doctor_config(tmp_path: Path, tiny_model, nats_url: str = "nats://127.0.0.1:4222", **sections) -> Path:
    """A config that `rlpipe doctor` finds healthy: its own ports (other tests may hold the defaults) and an admin
    token file."""
    token = tmp_path / "admin.token"
    token.write_text("s3cret\n")
    sections = {
        "nats": {"url": nats_url},
        "service": {"trainer_grpc_port": free_port()},
        "admin": {"port": free_port(), "token_file": str(token)},
        **sections,
    }
    return config_file(tmp_path, tiny_model, "run.yaml", **sections)
