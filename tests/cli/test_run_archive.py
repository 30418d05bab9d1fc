"""A finished run's record goes to the object store under <run>/archive/ (services/cli/run_archive.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.run_archive import archive_and_describe, archive_run
from services.common.config import load_config
from services.common.transport.storage import open_store
from tests.conftest import free_port, write_config

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
    model_dir, data_dir = tiny_model
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_config(
        write_config(
            tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs", run_id="archived", checkpoint=checkpoint
        )
    )
    for name, data in {**RECORD, **NOT_ARCHIVED}.items():
        (cfg.run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / name).write_bytes(data)
    return cfg


def test_the_record_of_a_finished_run_is_stored_under_its_archive_prefix_whole(tmp_path, tiny_model, s3_env):
    s3 = {"store_url": "s3://archive/runs", "s3_endpoint": s3_env, "s3_secure": False}
    cfg = run_with_record(tmp_path, tiny_model, s3)
    archived = archive_run(cfg)
    assert sorted(archived.keys) == sorted(RECORD)
    assert archived.nbytes == sum(len(data) for data in RECORD.values())
    store = open_store(cfg.checkpoint_url, cfg.checkpoint)
    assert store.list("archived/archive/") == sorted(f"archived/archive/{name}" for name in RECORD)
    for name, data in RECORD.items():
        assert store.get(f"archived/archive/{name}") == data
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
