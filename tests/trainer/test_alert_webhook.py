"""The trainer's webhook: retried with backoff against a real local HTTP server, and the dead-man heartbeat."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from services.trainer.alerts import WATCHDOG_RULE, Heartbeat, post_webhook

pytestmark = pytest.mark.integration


class FlakyReceiver(BaseHTTPRequestHandler):
    """Answers 503 to the first ``server.failures`` POSTs, 204 after; every POST's body goes to ``server.received``."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.posts += 1
        self.server.received.put(body)
        self.send_response(503 if self.server.posts <= self.server.failures else 204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def flaky():
    def start(failures: int) -> HTTPServer:
        server = HTTPServer(("127.0.0.1", 0), FlakyReceiver)
        server.failures = failures
        server.posts = 0
        server.received = queue.Queue()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    servers: list[HTTPServer] = []
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def bodies(server: HTTPServer, count: int) -> list[dict]:
    return [server.received.get(timeout=20) for _ in range(count)]


def test_a_webhook_failing_twice_is_retried_with_backoff_until_delivered(flaky, caplog):
    server = flaky(failures=2)
    payload = {"rule": "nan_loss", "severity": "critical", "step": 7}
    with caplog.at_level(logging.INFO, logger="rlpipe.alerts"):
        post_webhook(f"http://127.0.0.1:{server.server_port}/hook", payload, retries=3, backoff_s=0.05)
        assert bodies(server, 3) == [payload] * 3
        time.sleep(0.5)  # a fourth POST would come within this if the third success were not the end
    assert server.received.empty()
    events = [(r.getMessage(), r.fields.get("attempt"), r.fields.get("retry_s")) for r in caplog.records]
    assert events == [("alert_webhook_retry", 1, 0.05), ("alert_webhook_retry", 2, 0.1)]


def test_a_webhook_failing_past_its_retries_is_logged_once_with_the_attempts(flaky, caplog):
    server = flaky(failures=100)
    with caplog.at_level(logging.WARNING, logger="rlpipe.alerts"):
        post_webhook(f"http://127.0.0.1:{server.server_port}/hook", {"rule": "r"}, retries=2, backoff_s=0.05)
        assert len(bodies(server, 3)) == 3
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.02)
    [record] = caplog.records
    assert record.getMessage() == "alert_webhook_failed" and record.fields["attempts"] == 3
    assert "503" in record.fields["error"]


@pytest.mark.unit
def test_the_heartbeat_is_due_once_per_interval_and_never_when_off():
    heartbeat = Heartbeat()
    assert [heartbeat.due(now, 300.0) for now in (0.0, 10.0, 299.0, 300.0, 400.0, 600.0)] == [
        True,
        False,
        False,
        True,
        False,
        True,
    ]
    assert not Heartbeat().due(0.0, 0.0)
    payload = Heartbeat.payload("run-1", 12, 5.0)
    assert payload["rule"] == WATCHDOG_RULE and payload["severity"] == "none" and payload["step"] == 12
