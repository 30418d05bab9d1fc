"""What a days-long run writes stays within an operator-set bound: the rolled parts of metrics.jsonl and
events.jsonl past ``telemetry.jsonl_keep_parts`` are deleted oldest first, and the embedded broker's own log
rotates like the services' logs (``service.log_max_mib``, ``service.log_keep``)."""

from __future__ import annotations

import subprocess

import pytest
from pydantic import ValidationError

from services.common.config import ServiceConfig, TelemetryConfig
from services.common.observe.events import EventLog
from services.common.observe.logs import JsonlFollower, RollingJsonl, jsonl_parts, rolled_part
from services.common.observe.records import read_jsonl
from services.common.transport.nats_server import embedded_config, nats_server_binary
from services.trainer.responder import MetricsLog
from tests.support.servers import free_port, wait_for_port

pytestmark = pytest.mark.unit


def row(step: int) -> str:
    return f'{{"step": {step:4d}}}\n'  # the same length for every step


ROW = len(row(0))


def test_only_the_newest_parts_are_kept_and_numbering_goes_on_after_the_pruned_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    record = RollingJsonl(path, max_bytes=2 * ROW, keep_parts=3)  # two rows a part
    for step in range(1, 21):
        record.write(row(step))
    # 20 rows make 9 rolled parts and the current file; the 6 oldest parts went.
    assert jsonl_parts(path) == [rolled_part(path, n) for n in (7, 8, 9)] + [path]
    assert sorted(p.name for p in tmp_path.glob("metrics*.jsonl")) == [
        "metrics.00007.jsonl",
        "metrics.00008.jsonl",
        "metrics.00009.jsonl",
        "metrics.jsonl",
    ]
    assert [r["step"] for r in read_jsonl(path)] == list(range(13, 21))
    record.write(row(21))  # fills the current file: no roll yet
    record.write(row(22))  # rolls the current file to part 10 and prunes part 7
    assert jsonl_parts(path) == [rolled_part(path, n) for n in (8, 9, 10)] + [path]
    assert [r["step"] for r in read_jsonl(path)] == list(range(15, 23))


def test_keep_parts_zero_keeps_every_part_and_bad_bounds_are_refused(tmp_path):
    path = tmp_path / "events.jsonl"
    record = RollingJsonl(path, max_bytes=ROW, keep_parts=0)
    for step in range(1, 8):
        record.write(row(step))
    assert jsonl_parts(path) == [rolled_part(path, n) for n in range(1, 7)] + [path]
    with pytest.raises(ValueError, match="keep_parts"):
        RollingJsonl(path, max_bytes=ROW, keep_parts=-1)


def test_a_follower_reads_every_row_once_while_the_parts_it_has_read_are_pruned(tmp_path):
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsLog(path, max_bytes=2 * ROW + 40, keep_parts=2)
    follower = JsonlFollower(path)
    followed = []
    for step in range(1, 41):
        metrics.write({"step": step})
        if step % 3 == 0:  # more often than the record rolls, as `rlpipe metrics --follow` polls
            metrics.flush()
            followed += [r["step"] for r in follower.new_rows()]
    metrics.close()
    followed += [r["step"] for r in follower.new_rows()]
    assert followed == list(range(1, 41))
    assert len(jsonl_parts(path)) == 3  # two rolled parts and the current file
    assert rolled_part(path, 1) not in jsonl_parts(path)


def test_the_run_record_is_bounded_by_the_telemetry_settings(tmp_path):
    telemetry = TelemetryConfig()
    assert telemetry.jsonl_keep_parts == 20  # at 256 MiB a part: a record holds at most 21 x 256 MiB
    events = EventLog(tmp_path / "events.jsonl", max_bytes=ROW, keep_parts=telemetry.jsonl_keep_parts)
    assert events.file.keep_parts == 20
    with pytest.raises(ValidationError, match="jsonl_keep_parts"):
        TelemetryConfig(jsonl_keep_parts=-1)


def test_the_embedded_broker_rotates_its_own_log_by_the_service_log_settings(tmp_path):
    service = ServiceConfig(log_max_mib=3, log_keep=2)
    conf = embedded_config(4222, tmp_path / "store", False, "", (tmp_path / "nats.log", service))
    assert f'log_file: "{tmp_path / "nats.log"}"\n' in conf
    assert "logfile_size_limit: 3145728\n" in conf
    assert "logfile_max_num: 3\n" in conf  # nats-server counts the current file: two rotated ones beside it
    assert "log_file" not in embedded_config(4222, tmp_path / "store", False, "")


@pytest.mark.integration
def test_the_embedded_broker_writes_its_log_to_the_file_it_is_given(tmp_path):
    port, log = free_port(), tmp_path / "logs" / "nats.log"
    log.parent.mkdir()
    conf = tmp_path / "nats.conf"
    conf.write_text(embedded_config(port, tmp_path / "store", False, "", (log, ServiceConfig())))
    out = tmp_path / "logs" / "nats.out"
    with out.open("ab") as printed:
        server = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=printed, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, server, "nats-server")
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert "Server is ready" in log.read_text()
    assert out.read_bytes() == b""  # a healthy server prints nothing outside its log
