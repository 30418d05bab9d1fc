"""`rlpipe doctor --network`: round trips and throughput to the broker, the S3 store and the remote services,
measured for real (nats-server, moto, local HTTP servers), against what the config needs of each link."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.cli.doctor.network import nats_row, network_rows, store_row, weight_sync_row
from services.common.transport.storage import open_store
from tests.support.runs import run_config

pytestmark = pytest.mark.integration


@pytest.fixture
def model_and_data(tmp_path):
    """A model folder with 4 MiB of weights (one save: 12 MiB with AdamW's moments) and a dataset."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(bytes(4 << 20))
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "eval"):
        (data / f"{split}.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return model, data


def config(tmp_path, model_and_data, **sections):
    return run_config(tmp_path, model_and_data, **sections)


def step_rows(cfg, interval_s: float) -> None:
    """A run's metrics.jsonl whose steps came ``interval_s`` apart."""
    cfg.metrics_file.parent.mkdir(parents=True, exist_ok=True)
    row = {"step": 1, "time/wait_s": interval_s / 2, "time/compute_s": interval_s / 2}
    cfg.metrics_file.write_text("".join(json.dumps({**row, "step": step}) + "\n" for step in range(1, 4)))


@pytest.fixture
def http_service() -> Iterator[dict]:
    """A service answering every GET after ``delay_s`` (set by the test): the reward or environment endpoint."""
    state = {"delay_s": 0.0, "requests": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state["requests"] += 1
            time.sleep(state["delay_s"])
            self.send_response(405)  # a scoring endpoint takes POSTs: any answer is timed, not judged
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/score"
    yield state
    server.shutdown()
    server.server_close()


def test_the_s3_store_row_times_a_probe_object_against_the_save_at_a_stop(tmp_path, model_and_data, s3_env):
    store = {"store_url": "s3://doctor-net/ckpt", "s3_endpoint": s3_env, "s3_secure": False}
    cfg = config(tmp_path, model_and_data, checkpoint=store)
    row = store_row(cfg)
    assert row.status == "ok", row
    assert row.detail.startswith(f"s3://doctor-net/ckpt at {s3_env}: rtt ")
    assert " up " in row.detail and " down " in row.detail
    assert "one save (12.0 MiB) uploads in" in row.detail and "within supervision.trainer_stop_grace_s" in row.detail
    assert open_store("s3://doctor-net/ckpt", cfg.checkpoint).list(f"{cfg.run_id}/") == []  # the probe is gone

    hurried = config(tmp_path, model_and_data, checkpoint=store, supervision={"trainer_stop_grace_s": 0.001})
    short = store_row(hurried)
    assert short.status == "warn" and "this link is short" in short.detail


def test_the_remote_service_rows_time_connects_and_a_request_against_the_work_limit(
    tmp_path, model_and_data, http_service
):
    reward = {"functions": {}, "http": {"url": http_service["url"], "batch_size": 4}}
    cfg = config(tmp_path, model_and_data, reward=reward)
    rows = {row.name: row for row in network_rows(cfg, embedded=True)}
    assert rows["network reward"].status == "ok", rows["network reward"]
    assert f"reward.http.url {http_service['url']}: rtt " in rows["network reward"].detail
    assert "a group's 1 request(s) take at least" in rows["network reward"].detail
    assert http_service["requests"] == 1
    assert rows["network nats"].status == "skip"  # rlpipe run's own broker

    http_service["delay_s"] = 0.3
    slow = config(tmp_path, model_and_data, reward=reward, nats={"max_work_s": 0.5, "ack_wait_s": 30, "heartbeat_s": 5})
    (row,) = [row for row in network_rows(slow, embedded=True) if row.name == "network reward"]
    assert row.status == "warn" and "over half of nats.max_work_s (0.50 s): this link is short" in row.detail


def test_the_broker_row_sends_bytes_through_it_and_compares_a_step_with_the_runs_step_time(
    tmp_path, model_and_data, nats_url
):
    cfg = config(tmp_path, model_and_data, nats={"url": nats_url})
    row = nats_row(cfg, embedded=False)
    assert row.status == "ok", row
    assert row.detail.startswith(f"{nats_url}: rtt ") and "a step: unknown" in row.detail
    step_rows(cfg, interval_s=1e-6)  # steps a microsecond apart: no link carries a step's groups that fast
    short = nats_row(cfg, embedded=False)
    assert short.status == "warn" and "over half of a step (0.00 s)" in short.detail


@pytest.mark.unit
def test_the_weight_sync_row_sizes_a_version_against_the_configured_link_and_the_step_time(tmp_path, model_and_data):
    unknown = weight_sync_row(config(tmp_path, model_and_data))
    assert unknown.status == "ok" and "telemetry.link_mib_s: unknown" in unknown.detail
    cfg = config(tmp_path, model_and_data, telemetry={"link_mib_s": 1.0}, rollout={"replicas": 2, "relay_fanout": 0})
    step_rows(cfg, interval_s=4.0)
    row = weight_sync_row(cfg)
    # 4 MiB to each of 2 replicas over a 1 MiB/s link: 8 s, against steps 4 s apart.
    assert row.status == "warn" and "a version (4.0 MiB) to 2 replica(s) takes ~8.00 s" in row.detail, row


@pytest.mark.unit
def test_the_weight_sync_row_sizes_rollout_replicas_auto_at_the_most_replicas_it_may_start(tmp_path, model_and_data):
    rollout = {"replicas": "auto", "auto_max_replicas": 3, "relay_fanout": 0}
    cfg = config(tmp_path, model_and_data, telemetry={"link_mib_s": 1.0}, rollout=rollout)
    row = weight_sync_row(cfg)
    # 4 MiB to each of at most 3 replicas over a 1 MiB/s link: 12 s.
    assert "a version (4.0 MiB) to at most 3 replica(s) (rollout.replicas: auto) takes ~12.00 s" in row.detail, row
