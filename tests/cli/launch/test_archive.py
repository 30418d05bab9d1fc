"""A finished run's record goes to the object store under <run>/archive/ (services/cli/launch/archive.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from services.cli.launch.archive import RunArchiver, archive_and_describe, archive_run, archive_until_stopped
from services.common.transport.lifecycle_tags import ARCHIVE_TAG
from services.common.transport.storage import open_store
from services.trainer.checkpointing.resume import SavedRecord
from services.trainer.checkpointing.store import CheckpointStore
from tests.support.paths import ROOT
from tests.support.runs import run_config
from tests.support.servers import free_port
from tests.support.trainer import checkpoint

pytestmark = pytest.mark.integration

RECORD = {
    "metrics.00001.jsonl": b'{"step": 1}\n',
    "metrics.jsonl": b'{"step": 2}\n',
    "events.jsonl": b'{"kind": "alert"}\n',
    "lineage.jsonl": b'{"step": 1, "groups": []}\n',
    "run.json": b"{}",
    "effective-config.yaml": b"run_id: archived\n",
    "logs/trainer.log": b"now\n",
    "logs/trainer.log.1": b"before\n",
    "logs/reward-0.log": b"scored\n",
}
NOT_ARCHIVED = {"samples/step_1.jsonl": b"{}\n", "step-00000002/manifest.json": b"{}", "nats/jetstream/x": b"x"}


def run_with_record(tmp_path: Path, tiny_model, checkpoint: dict) -> tuple:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = run_config(tmp_path, tiny_model, run_id="archived", checkpoint=checkpoint)
    for name, data in {**RECORD, **NOT_ARCHIVED}.items():
        (cfg.run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / name).write_bytes(data)
    return cfg


def test_the_record_of_a_finished_run_is_stored_under_its_archive_prefix_whole_tagged_for_the_archive_rule(
    tmp_path, tiny_model, s3_env
):
    s3 = {"store_url": "s3://archive/runs", "s3_endpoint": s3_env, "s3_secure": False}
    cfg = run_with_record(tmp_path, tiny_model, s3)
    archived = archive_run(cfg)
    assert sorted(archived.keys) == sorted(RECORD)
    assert archived.nbytes == sum(len(data) for data in RECORD.values())
    store = open_store(cfg.checkpoint_url, cfg.checkpoint)
    assert store.list("archived/archive/") == sorted(f"archived/archive/{name}" for name in RECORD)
    for name, data in RECORD.items():
        assert store.get(f"archived/archive/{name}") == data
        tags = store.client.get_object_tags(store.bucket, store._key(f"archived/archive/{name}"))
        assert dict(tags) == dict([ARCHIVE_TAG]), name  # what the bucket's lifecycle rule selects
    assert archive_and_describe(cfg).startswith(f"archive: {len(RECORD)} files (0.0 MiB) in s3://archive/runs/")


def test_a_file_store_holding_the_run_folder_itself_copies_nothing_and_an_unreachable_store_loses_nothing(
    tmp_path, tiny_model, s3_env
):
    cfg = run_with_record(tmp_path, tiny_model, {})  # the embedded default: file://<runs_dir>
    assert archive_run(cfg).skipped == f"the store keeps the run in {cfg.run_dir} already"
    assert not (cfg.run_dir / "archive").exists()

    down = {"store_url": "s3://archive/runs", "s3_endpoint": f"127.0.0.1:{free_port()}", "s3_secure": False}
    cfg = run_with_record(tmp_path / "down", tiny_model, down)
    said = archive_and_describe(cfg)
    assert said.startswith("archive: the run's record could not be stored (") and said.endswith(f"{cfg.run_dir}")
    assert (cfg.run_dir / "metrics.jsonl").read_bytes() == RECORD["metrics.jsonl"]


def test_a_store_without_the_checkpoints_the_run_saved_gets_no_archive_until_it_holds_them(
    tmp_path, tiny_model, s3_env
):
    """The run's own record says it saved step 4, and the store holds none of the run's steps (moved away, a bucket
    re-created): a resume waits for such a store rather than take it for empty, and the run's end must not write
    into it either. Once the store holds the step again, the record is archived there."""
    cfg = run_with_record(tmp_path, tiny_model, {**S3, "store_url": "s3://archive-moved/runs", "s3_endpoint": s3_env})
    location = "s3://archive-moved/runs/archived/step-00000004/"
    SavedRecord(step=4, policy_version=4, incarnation="i", location=location).write(cfg.run_dir)
    said = archive_and_describe(cfg)
    assert said.startswith("archive: not copied: archived's checkpoints are not where its record says (")
    assert "holds no checkpoint of this run, but step 4" in said and said.endswith(f"it stays in {cfg.run_dir}")
    store = open_store(cfg.checkpoint_url, cfg.checkpoint)
    assert store.list("archived/") == []  # not one object

    CheckpointStore(store, "archived", keep_last=5, incarnation="i").save(checkpoint(4, "i"), tmp_path)
    assert sorted(archive_run(cfg).keys) == sorted(RECORD)


# ------------------------------------------------------------------ rlpipe archive: beside a trainer it does not run

S3 = {"store_url": "s3://archive/runs", "s3_secure": False}
SERVICE_LOGS = {"reward-abc.log": b"scored\n", "rollout-def.log": b"sampled\n", "rollout-def.log.1": b"earlier\n"}


def services_logs(tmp_path: Path) -> Path:
    logs = tmp_path / "service-logs"
    logs.mkdir(parents=True)
    for name, data in SERVICE_LOGS.items():
        (logs / name).write_bytes(data)
    return logs


def test_each_pass_stores_what_changed_and_the_services_logs_go_under_logs(tmp_path, tiny_model, s3_env):
    cfg = run_with_record(tmp_path, tiny_model, {**S3, "s3_endpoint": s3_env})
    archiver = RunArchiver(cfg, logs_dir=services_logs(tmp_path))
    first = archiver.archive()
    assert sorted(first.keys) == sorted([*RECORD, *(f"logs/{name}" for name in SERVICE_LOGS)])
    assert archiver.archive().keys == []  # nothing changed
    with (cfg.run_dir / "metrics.jsonl").open("ab") as metrics:
        metrics.write(b'{"step": 3}\n')
    (tmp_path / "service-logs" / "reward-abc.log").write_bytes(b"scored\nscored again\n")
    assert sorted(archiver.archive().keys) == ["logs/reward-abc.log", "metrics.jsonl"]
    store = open_store(cfg.checkpoint_url, cfg.checkpoint)
    assert store.get("archived/archive/metrics.jsonl") == b'{"step": 2}\n{"step": 3}\n'
    assert store.get("archived/archive/logs/rollout-def.log.1") == b"earlier\n"


def test_the_loop_makes_one_last_pass_once_stopped(tmp_path, tiny_model, s3_env):
    cfg = run_with_record(tmp_path, tiny_model, {**S3, "s3_endpoint": s3_env})
    stop, said = threading.Event(), []
    stop.set()  # as SIGTERM before the first period is over
    archive_until_stopped(RunArchiver(cfg), 3600.0, stop, said.append)
    assert said == [f"archive: {len(RECORD)} files (0.0 MiB) in s3://archive/runs/archived/archive/"]


def test_rlpipe_archive_every_copies_the_record_when_terminated_and_exits_0(tmp_path, tiny_model, s3_env):
    # A bucket of its own: the store server is the session's, and the other tests archive the same run id.
    cfg = run_with_record(tmp_path, tiny_model, {**S3, "store_url": "s3://archive-every/runs", "s3_endpoint": s3_env})
    config = tmp_path / "c.yaml"
    logs = services_logs(tmp_path)
    command = [sys.executable, "-m", "services.cli", "archive", "--config", str(config), "--logs", str(logs)]
    process = subprocess.Popen([*command, "--every", "3600"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    store = open_store(cfg.checkpoint_url, cfg.checkpoint)
    try:
        # Printed once its signal handlers are set (a SIGTERM before them would just kill it).
        started = process.stdout.readline()
        assert started == "archive: a pass every 3600 s to archived/archive/, and a last one when stopped\n"
        # The first pass is a period away: nothing is stored until the stop asks for the last one.
        assert store.list("archived/archive/") == []
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0
    files = len(RECORD) + len(SERVICE_LOGS)
    assert out == f"archive: {files} files (0.0 MiB) in s3://archive-every/runs/archived/archive/\n"
    assert len(store.list("archived/archive/")) == len(RECORD) + len(SERVICE_LOGS)

    down = {**S3, "s3_endpoint": f"127.0.0.1:{free_port()}"}
    run_with_record(tmp_path / "down", tiny_model, down)
    once = subprocess.run(
        [sys.executable, "-m", "services.cli", "archive", "--config", str(tmp_path / "down" / "c.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert once.returncode == 1 and "could not be stored" in once.stderr
