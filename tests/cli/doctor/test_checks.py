"""`rlpipe doctor` against real parts: nats-server, moto S3, real files and sockets.

Each failure case asserts the exit code and that the failing check and its reason are named.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket

import grpc
import nats
import pytest
import torch
from nats.js import api

from services.cli.doctor.checks import _doctor_checks, check_packages
from services.cli.doctor.weightsync import weight_sync_rows
from services.common.config import CheckpointConfig, load_config
from services.common.pb import weights_pb2_grpc
from services.common.startup_checks.machine import check_ports
from services.common.startup_checks.roles import _startup_checks, startup_checks
from services.common.startup_checks.rows import StartupCheckError
from services.common.startup_checks.storage import check_storage
from services.common.startup_checks.tokens import check_admin_read_token, check_admin_token, check_weight_sync_token
from services.common.transport.bus import Bus
from services.common.transport.streams import PROMPTS, stream_name, subject
from services.common.transport.weightsync.auth import WeightSyncToken
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import Snapshot
from tests.support.runs import config_file, doctor, doctor_config, run_config, write_config
from tests.support.servers import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def no_admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLPIPE_ADMIN_TOKEN", raising=False)


def test_healthy_local_setup_passes(tiny_model, tmp_path, nats_url, no_admin_token):
    config = doctor_config(tmp_path, tiny_model, nats_url)

    async def create_the_runs_streams() -> None:
        bus = await Bus(load_config(config), "test").connect()
        await bus.close()

    asyncio.run(create_the_runs_streams())
    done = doctor(config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rlpipe doctor: no check failed" in done.stdout
    assert "JetStream enabled" in done.stdout
    assert "5 of the run's 5 streams exist and match the config" in done.stdout
    assert "write, read and delete work" in done.stdout
    assert "admin.token_file" in done.stdout
    assert "(estimate, +25% headroom)" in done.stdout  # the sizing row of `rlpipe plan`'s estimate
    # The probe leaves nothing behind in the store.
    assert not list((tmp_path / "runs").glob(".rlpipe-doctor-*"))


def test_embedded_checks_the_broker_binary_not_nats_url(tiny_model, tmp_path, no_admin_token):
    # rlpipe run starts its own broker and makes the admin token,
    # so neither a closed nats.url nor a missing token fails.
    config = config_file(
        tmp_path, tiny_model, "run.yaml", nats={"url": f"nats://127.0.0.1:{free_port()}"}, admin={"port": free_port()}
    )
    done = doctor(config, "--embedded")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rlpipe run starts its own broker, nats-server" in done.stdout
    assert "rlpipe run generates one" in done.stdout and "rlpipe doctor: no check failed (1 warning)" in done.stdout


def test_missing_model_path_fails_naming_it(tiny_model, tmp_path, nats_url):
    missing = tmp_path / "no-such-model"
    done = doctor(doctor_config(tmp_path, tiny_model, nats_url, model={"path": str(missing)}))
    assert done.returncode == 1
    assert "FAIL config: " in done.stdout and f"model.path: model folder '{missing}' does not exist" in done.stdout
    assert "rlpipe doctor: 1 failed: config" in done.stdout
    # The rest of the config is still checked.
    assert "write, read and delete work" in done.stdout and "JetStream enabled" in done.stdout


def test_doctor_json_lists_every_check_with_its_status_and_exits_as_the_table_does(tiny_model, tmp_path, nats_url):
    missing = tmp_path / "no-such-model"
    done = doctor(doctor_config(tmp_path, tiny_model, nats_url, model={"path": str(missing)}), "--json")
    assert done.returncode == 1
    checks = {check["name"]: check for check in json.loads(done.stdout)}
    assert (
        checks["config"]["status"] == "fail"
        and f"model folder '{missing}' does not exist" in checks["config"]["detail"]
    )
    assert checks["nats"]["status"] == "ok" and all(
        set(check) == {"name", "status", "detail"} for check in checks.values()
    )


def test_model_folder_without_tokenizer_fails(tiny_model, tmp_path, nats_url):
    model_dir, _ = tiny_model
    bare = tmp_path / "bare-model"
    bare.mkdir()
    shutil.copy(model_dir / "config.json", bare / "config.json")
    done = doctor(doctor_config(tmp_path, tiny_model, nats_url, model={"path": str(bare)}))
    assert done.returncode == 1
    assert f"FAIL model: {bare}: the tokenizer is empty" in done.stdout


def test_unwritable_storage_fails_naming_it(tiny_model, tmp_path, nats_url):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    url = (blocker / "checkpoints").as_uri()
    done = doctor(doctor_config(tmp_path, tiny_model, nats_url, checkpoint={"store_url": url}))
    assert done.returncode == 1
    assert f"FAIL storage: {url}: write failed:" in done.stdout
    assert "rlpipe doctor: 1 failed: storage" in done.stdout


def test_s3_storage_probe(s3_env):
    reachable = CheckpointConfig(store_url="s3://doctor/ckpt", s3_endpoint=s3_env, s3_secure=False)
    result = check_storage(reachable.store_url, reachable)
    assert result.status == "ok", result.detail
    dead = CheckpointConfig(store_url="s3://doctor/ckpt", s3_endpoint=f"127.0.0.1:{free_port()}", s3_secure=False)
    result = check_storage(dead.store_url, dead)
    # Opening a store contacts no endpoint (a resume waits for one that is down): the first write fails.
    assert result.status == "fail" and result.detail.startswith("s3://doctor/ckpt: write failed:")


class RefusingS3:
    """A real HTTP endpoint that answers every S3 request 403 AccessDenied, as a store refusing our key does."""

    def __init__(self) -> None:
        import http.server
        import threading

        class Refuse(http.server.BaseHTTPRequestHandler):
            def refuse(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = refuse

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_store_out_of_reach_fails_a_fresh_start_but_only_warns_a_resume_and_a_refusing_one_fails_both(
    s3_env, tmp_path
):
    """A resume waits out a store outage (checkpoint.resume_wait_s); refused at its start-up check instead, a
    restarted trainer exited 2, which no supervisor restarts, and a passing outage ended the run. A store that
    refuses us is a configuration to fix, named, whether the run resumes or not."""
    dead = CheckpointConfig(store_url="s3://doctor/ckpt", s3_endpoint=f"127.0.0.1:{free_port()}", s3_secure=False)
    fresh = check_storage(dead.store_url, dead)
    assert fresh.status == "fail" and fresh.detail.endswith(
        "never reached at a fresh start: check checkpoint.s3_endpoint and the bucket"
    )
    resumed = check_storage(dead.store_url, dead, resume=True)
    assert resumed.status == "warn" and "out of reach, not refusing: the resume waits for it" in resumed.detail

    refusing = RefusingS3()
    try:
        denied = CheckpointConfig(store_url="s3://doctor/ckpt", s3_endpoint=refusing.endpoint, s3_secure=False)
        for resume in (False, True):
            result = check_storage(denied.store_url, denied, resume=resume)
            assert result.status == "fail", result.detail
            assert "refuses these credentials: check RLPIPE_S3_ACCESS_KEY and RLPIPE_S3_SECRET_KEY" in result.detail
    finally:
        refusing.close()

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    in_the_way = CheckpointConfig(store_url=(blocker / "ckpt").as_uri())
    result = check_storage(in_the_way.store_url, in_the_way, resume=True)
    assert result.status == "fail" and "checkpoint.store_url cannot hold a store here (ENOTDIR)" in result.detail


def test_a_remote_reward_out_of_reach_fails_naming_its_url_and_one_that_answers_passes(tiny_model, tmp_path, nats_url):
    with socket.create_server(("127.0.0.1", 0)) as listening:
        up = f"http://127.0.0.1:{listening.getsockname()[1]}/score"
        done = doctor(doctor_config(tmp_path, tiny_model, nats_url, reward={"http": {"url": up}}))
    assert done.returncode == 0, done.stdout
    assert f"reward.http.url {up}: reachable" in done.stdout
    down = f"http://127.0.0.1:{free_port()}/score"
    done = doctor(doctor_config(tmp_path, tiny_model, nats_url, reward={"http": {"url": down}}))
    assert done.returncode == 1
    assert f"FAIL remote services: reward.http.url {down}: 127.0.0.1:" in done.stdout
    assert "rlpipe doctor: 1 failed: remote services" in done.stdout


def test_nats_down_fails_naming_it(tiny_model, tmp_path):
    url = f"nats://127.0.0.1:{free_port()}"
    done = doctor(doctor_config(tmp_path, tiny_model, url))
    assert done.returncode == 1
    assert f"FAIL nats: cannot connect to {url}" in done.stdout
    assert "rlpipe doctor: 1 failed: nats" in done.stdout


def test_a_message_limit_above_the_brokers_max_payload_fails_naming_both(tiny_model, tmp_path, nats_url):
    done = doctor(doctor_config(tmp_path, tiny_model, nats_url, nats={"url": nats_url, "max_message_bytes": 2 * 2**20}))
    assert done.returncode == 1
    assert "nats.max_message_bytes is 2097152 bytes but the broker takes at most 1048576" in done.stdout
    assert "rlpipe doctor: 1 failed: nats" in done.stdout


def test_wrong_stream_settings_fail_naming_stream_and_setting(tiny_model, tmp_path, nats_url):
    config = doctor_config(tmp_path, tiny_model, nats_url)
    name = stream_name("test", PROMPTS)

    async def create_a_stale_stream() -> None:
        nc = await nats.connect(nats_url)
        stale = api.StreamConfig(
            name=name,
            subjects=[subject("test", PROMPTS)],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.MEMORY,
            duplicate_window=120,
        )
        await nc.jetstream().add_stream(stale)
        await nc.close()

    asyncio.run(create_a_stale_stream())
    done = doctor(config)
    assert done.returncode == 1
    [line] = [line for line in done.stdout.splitlines() if line.startswith("FAIL streams:")]
    assert f"{name}: retention expected workqueue, found limits" in line
    assert f"{name}: storage expected file, found memory" in line
    assert f"{name}: duplicate_window expected 600, found 120" in line


def test_malformed_dataset_lines_fail_with_line_numbers(tiny_model, tmp_path, nats_url):
    train = tmp_path / "train.jsonl"
    train.write_text(
        '{"prompt": "1+1=", "answer": "2"}\n'
        "{not json\n"
        "\n"
        '["a", "list"]\n'
        '{"prompt": "2+2="}\n'
        '{"prompt": "3+3=", "answer": "6"}\n'
    )
    done = doctor(doctor_config(tmp_path, tiny_model, nats_url, data={"train_path": str(train)}))
    assert done.returncode == 1
    [line] = [line for line in done.stdout.splitlines() if line.startswith("FAIL dataset data.train_path:")]
    assert f"{train}: 3 bad of 6 lines:" in line
    assert re.search(
        r"line 2: invalid JSON \(.+\); line 4: not a JSON object; line 5: missing or non-string field 'answer'", line
    )


def test_busy_port_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = check_ports("127.0.0.1", {"admin.port": port, "telemetry.metrics_port": 0})
    assert result.status == "fail" and result.detail.startswith(f"admin.port {port} on 127.0.0.1:")
    assert "metrics" not in result.detail


def test_admin_token_is_required_unless_the_launcher_makes_one(tiny_model, tmp_path, no_admin_token):
    cfg = run_config(tmp_path, tiny_model)
    assert check_admin_token(cfg, launcher_generates=True).status == "warn"
    assert check_admin_token(cfg, launcher_generates=False).status == "fail"
    prod = run_config(tmp_path, tiny_model, "p.yaml", environment="prod")
    assert check_admin_token(prod, launcher_generates=True).status == "fail"


@pytest.mark.unit
def test_packages_against_a_lock(tmp_path):
    import torch

    lock = tmp_path / "requirements.lock"
    public_torch = torch.__version__.split("+")[0]  # the lock pins the public version of a +cpu build
    lock.write_text(
        f"# pinned\ntorch=={public_torch}\npytest==0.0.1\nno-such-package-rlpipe==1.0\n"
        "win-only==1.0 ; sys_platform == 'win32'\n"
    )
    result = check_packages(lock)
    assert result.status == "fail"
    assert "mismatched: pytest" in result.detail and "(lock 0.0.1)" in result.detail
    assert "missing: no-such-package-rlpipe==1.0" in result.detail
    assert "torch" not in result.detail and "win-only" not in result.detail
    assert check_packages(tmp_path / "absent.lock").status == "skip"


@pytest.mark.unit
def test_packages_of_an_image_count_only_what_its_recorded_extras_install(tmp_path):
    import torch

    lock = tmp_path / "requirements.lock"
    public_torch = torch.__version__.split("+")[0]
    # pytest comes with the test extra only; an image installed without it must not fail on its pin.
    lock.write_text(f"torch=={public_torch}\npytest==0.0.1\nno-such-package-rlpipe==1.0\n")

    slim = check_packages(record={"extras": [], "lock": str(lock), "requirements": None})
    with_tests = check_packages(record={"extras": ["test"], "lock": str(lock), "requirements": None})
    requirements = tmp_path / "requirements-cuda.txt"
    requirements.write_text("# the GPU image's own pins\nno-such-package-rlpipe==1.0\n")
    gpu = check_packages(record={"extras": [], "lock": str(lock), "requirements": str(requirements)})

    assert slim.status == "ok", slim.detail
    assert slim.detail == f"1 pinned packages match {lock}"
    assert with_tests.status == "fail" and with_tests.detail == "mismatched: pytest " + pytest.__version__ + (
        " (lock 0.0.1)"
    )
    assert gpu.status == "fail" and gpu.detail == "missing: no-such-package-rlpipe==1.0"


def test_startup_checks_name_each_failure_for_the_roles_that_need_them(tiny_model, tmp_path, no_admin_token):
    train = tmp_path / "train.jsonl"
    train.write_text("garbage\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = run_config(
        tmp_path,
        tiny_model,
        data={"train_path": str(train)},
        checkpoint={"store_url": (blocker / "ckpt").as_uri()},
        service={"trainer_grpc_port": free_port()},
        admin={"port": free_port()},
    )
    with pytest.raises(StartupCheckError) as raised:
        startup_checks(cfg, "trainer")
    failed = {result.name for result in raised.value.failures}
    assert failed == {"dataset data.train_path", "storage", "admin token"}
    assert "trainer start-up checks failed" in str(raised.value) and "line 1: invalid JSON" in str(raised.value)
    # Reward reads neither the data nor the store; the launcher makes the token.
    assert {result.name for result in startup_checks(cfg, "reward")} == {"ports"}
    with pytest.raises(StartupCheckError) as raised:
        startup_checks(cfg, "run")
    assert {result.name for result in raised.value.failures} == {"dataset data.train_path", "storage"}


WEIGHT_SYNC_TOKEN = "the-runs-weight-sync-token"


def test_the_weight_sync_token_is_required_where_the_trainer_needs_one(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("RLPIPE_WEIGHTSYNC_TOKEN", raising=False)
    monkeypatch.delenv("RLPIPE_ENV", raising=False)
    dev = run_config(tmp_path, tiny_model, "d.yaml")
    prod = run_config(tmp_path, tiny_model, "p.yaml", environment="prod")
    assert [(r.status, r.detail) for r in weight_sync_rows(prod, embedded=False)[:1]] == [
        ("fail", "RLPIPE_WEIGHTSYNC_TOKEN is not set: a prod trainer refuses to start without one")
    ]
    assert weight_sync_rows(dev, embedded=False)[0].status == "warn"  # an open port: weight_sync_open at start
    assert [r.status for r in weight_sync_rows(prod, embedded=True)] == ["ok"]  # rlpipe run makes one
    monkeypatch.setenv("RLPIPE_WEIGHTSYNC_TOKEN", WEIGHT_SYNC_TOKEN)
    assert weight_sync_rows(prod, embedded=False)[0].detail == "set by RLPIPE_WEIGHTSYNC_TOKEN"
    assert "weight-sync token" in [check.name for check in _doctor_checks(embedded=False)]


@pytest.mark.unit
def test_a_token_that_cannot_go_into_a_calls_metadata_fails_the_start_named_never_quoted(
    config_only_model, tmp_path, monkeypatch
):
    """gRPC refuses a metadata value with a line break ('Invalid metadata'): every call would fail, so each such
    token fails the start checks of the roles that send it, naming where it came from."""
    token_file = tmp_path / "admin.token"
    token_file.write_text("LEAKED-admin\nsecond-line\n")
    cfg = run_config(tmp_path, config_only_model, admin={"token_file": str(token_file)})
    monkeypatch.delenv("RLPIPE_ADMIN_TOKEN", raising=False)
    from_file = check_admin_token(cfg, launcher_generates=False)
    assert from_file.status == "fail" and from_file.detail.startswith("admin.token_file: the token in")
    monkeypatch.setenv("RLPIPE_ADMIN_TOKEN", "LEAKED-adm\u00efn")
    from_env = check_admin_token(cfg, launcher_generates=False)
    assert (from_env.status, from_env.detail) == ("fail", "RLPIPE_ADMIN_TOKEN holds a character outside ASCII")
    monkeypatch.setenv("RLPIPE_WEIGHTSYNC_TOKEN", "LEAKED-sync\r\nx")
    [sync] = weight_sync_rows(cfg, embedded=True)
    assert (sync.status, sync.detail) == ("fail", "RLPIPE_WEIGHTSYNC_TOKEN holds a line break")
    at_start = check_weight_sync_token()
    assert (at_start.status, at_start.detail) == ("fail", "RLPIPE_WEIGHTSYNC_TOKEN holds a line break")
    for role in ("trainer", "rollout", "run"):  # the roles that send or serve it
        assert "weight-sync token" in [check.name for check in _startup_checks(role)]
    assert "LEAKED" not in from_file.detail + from_env.detail + sync.detail + at_start.detail


def test_a_serving_trainers_port_must_refuse_a_call_without_the_token_and_take_the_runs(
    tiny_model, tmp_path, monkeypatch
):
    """Against real WeightSync servers: one checking the token, one open, and none at all."""
    model_dir, data_dir = tiny_model
    monkeypatch.delenv("RLPIPE_ENV", raising=False)

    def rows_for(port: int, token: str) -> list[tuple[str, str]]:
        monkeypatch.setenv("RLPIPE_WEIGHTSYNC_TOKEN", token)
        cfg = load_config(
            write_config(
                tmp_path / f"c{port}.yaml",
                model_dir,
                data_dir,
                tmp_path / "runs",
                service={"host": "127.0.0.1", "trainer_grpc_port": port},
            )
        )
        return [(r.status, r.detail) for r in weight_sync_rows(cfg, embedded=False)[1:]]

    async def serving(interceptors: list) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=interceptors)
        snapshot = Snapshot(1, 1, (("w", torch.zeros(4)),))
        weights_pb2_grpc.add_WeightSyncServicer_to_server(WeightSyncServer(snapshot), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    async def scenario() -> dict[str, list[tuple[str, str]]]:
        guarded, guarded_port = await serving([WeightSyncToken(WEIGHT_SYNC_TOKEN)])
        open_, open_port = await serving([])
        try:
            return {
                "right": await asyncio.to_thread(rows_for, guarded_port, WEIGHT_SYNC_TOKEN),
                "wrong": await asyncio.to_thread(rows_for, guarded_port, "not-the-runs"),
                "open": await asyncio.to_thread(rows_for, open_port, WEIGHT_SYNC_TOKEN),
                "none": await asyncio.to_thread(rows_for, free_port(), WEIGHT_SYNC_TOKEN),
            }
        finally:
            await guarded.stop(0)
            await open_.stop(0)

    found = asyncio.run(scenario())
    assert [status for status, _ in found["right"]] == ["ok"]
    assert found["right"][0][1].endswith("refuses a call without the token and takes this one")
    assert found["wrong"] == [("fail", found["wrong"][0][1])]
    assert "refuses RLPIPE_WEIGHTSYNC_TOKEN (UNAUTHENTICATED): not the run's token" in found["wrong"][0][1]
    assert found["open"] == [("fail", found["open"][0][1])]
    assert found["open"][0][1].endswith("serves weights to a caller without the token")
    assert [status for status, _ in found["none"]] == ["skip"]


@pytest.mark.unit
def test_the_start_checks_report_the_read_token_when_set_and_name_a_bad_one_never_quoting_it(
    config_only_model, tmp_path, monkeypatch
):
    monkeypatch.delenv("RLPIPE_ADMIN_READ_TOKEN", raising=False)
    read_file = tmp_path / "admin-read.token"
    read_file.write_text("fine\n")
    cfg = run_config(tmp_path, config_only_model, admin={"read_token_file": str(read_file)})
    [row] = check_admin_read_token(cfg)
    assert (row.name, row.status) == ("admin read token", "ok") and str(read_file) in row.detail
    read_file.write_text("LEAKED-read\nsecond-line\n")
    [row] = check_admin_read_token(cfg)
    assert row.status == "fail" and row.detail.startswith("admin.read_token_file: the token in")
    monkeypatch.setenv("RLPIPE_ADMIN_READ_TOKEN", "LEAKED-re\u00e4d")
    [from_env] = check_admin_read_token(cfg)
    assert (from_env.status, from_env.detail) == ("fail", "RLPIPE_ADMIN_READ_TOKEN holds a character outside ASCII")
    assert "LEAKED" not in row.detail + from_env.detail
    monkeypatch.delenv("RLPIPE_ADMIN_READ_TOKEN")
    assert check_admin_read_token(run_config(tmp_path, config_only_model, "none.yaml")) == []  # none set: no row
