"""The S3 endpoint goes away mid-run: saves fail and are retried, training goes on, and saves succeed again."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from services.common.config import CheckpointConfig
from services.common.storage import open_store
from services.report import read_jsonl
from services.trainer.checkpoint import CheckpointStore
from tests.conftest import BIN, free_port, rlpipe, running_pipeline, wait_for, wait_for_port, write_config

# Long enough to train through the outage (a failed save retries for ~7 s), so the last save meets a live store.
TOTAL_STEPS = 150


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


def test_checkpoints_survive_an_object_store_outage(tiny_model, tmp_path, s3):
    model_dir, data_dir = tiny_model
    checkpoint = s3.checkpoint(save_every_steps=2, keep_last=20)
    config = write_config(
        tmp_path / "c.yaml",
        model_dir,
        data_dir,
        tmp_path / "runs",
        run_id="outage",
        train={"total_steps": TOTAL_STEPS, "batch_size": 8, "learning_rate": 1e-5},
        checkpoint=checkpoint,
    )
    metrics = tmp_path / "runs" / "outage" / "metrics.jsonl"
    with running_pipeline(config) as run:
        deadline = time.monotonic() + 300
        while not any("checkpoint_saved" in r for r in read_jsonl(metrics)):
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        s3.stop()
        # An operator can still ask how the run is: status answers and says the store is unreadable.
        during = rlpipe(tmp_path / "runs" / "outage", "status", "--json")
        assert during.returncode == 0, during.stderr
        assert json.loads(during.stdout)["checkpoint_store_error"]
        assert "unreadable" in rlpipe(tmp_path / "runs" / "outage", "status").stdout
        while not any(r.get("checkpoint_failed") for r in read_jsonl(metrics)):
            assert run.poll() is None and time.monotonic() < deadline, "no failed save while the store was down"
            time.sleep(0.2)
        failed_at = max(r["step"] for r in read_jsonl(metrics) if r.get("checkpoint_failed"))
        steps_during_outage = [r["step"] for r in read_jsonl(metrics) if "pg_loss" in r and r["step"] > failed_at]
        s3.start()
        output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output[-4000:]
    all_rows = read_jsonl(metrics)
    assert [r["step"] for r in all_rows if "pg_loss" in r] == list(range(1, TOTAL_STEPS + 1))  # training never stopped
    assert steps_during_outage or failed_at < TOTAL_STEPS
    saved_after = [r["step"] for r in all_rows if "checkpoint_saved" in r and r["step"] > failed_at]
    assert saved_after and saved_after[-1] == TOTAL_STEPS
    log = (tmp_path / "runs" / "outage" / "logs" / "trainer.log").read_text()
    assert '"store_retry"' in log and '"checkpoint_failed"' in log and '"alert": true' in log
    # Only complete steps exist for loaders, and each loads with matching hashes.
    cfg = CheckpointConfig(**{k: v for k, v in checkpoint.items() if k.startswith("s3_")})
    store = CheckpointStore(open_store(checkpoint["store_url"], cfg), "outage", keep_last=20)
    assert store.steps() and store.steps()[-1] == TOTAL_STEPS
    for step in store.steps():
        assert store.load(step).step == step


def test_a_run_that_ends_with_its_last_steps_unsaved_does_not_exit_clean(tiny_model, tmp_path, s3):
    model_dir, data_dir = tiny_model
    config = write_config(
        tmp_path / "c.yaml",
        model_dir,
        data_dir,
        tmp_path / "runs",
        run_id="unsaved",
        train={"total_steps": 8, "batch_size": 8, "learning_rate": 1e-5},
        checkpoint=s3.checkpoint(save_every_steps=1000),
    )
    run_dir = tmp_path / "runs" / "unsaved"
    with running_pipeline(config) as run:
        wait_for(
            lambda: (run_dir / "run.json").exists(), "every service ready", run
        )  # the start-up checks wrote to the store
        s3.stop()
        output, _ = run.communicate(timeout=600)
    # The final save failed: the trainer says so and exits 1, and so does `rlpipe run`.
    assert run.returncode == 1, output[-3000:]
    assert "services failed" in output and "trainer" in output.split("services failed")[-1]
    assert '"ended_unsaved"' in (run_dir / "logs" / "trainer.log").read_text()
