"""The remote reward client against the reference server, a real process on a real socket."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys

import pytest

from services.common.config import RewardHttpConfig
from services.common.transport.bus import BreakerState, DependencyUnavailable
from services.reward.remote import RemoteItem, RemoteRewardRejected, RemoteScorer, _RequestFailed, parse_scores
from tests.conftest import free_port, wait_for_port

pytestmark = pytest.mark.integration


def start_server(port: int, *options: str) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "services.reward.reference_server", "--port", str(port), *options],
        stdout=subprocess.DEVNULL,
    )
    wait_for_port(port, server, "reference reward server")
    return server


@pytest.fixture
def port():
    return free_port()


def scorer(port: int, **settings) -> RemoteScorer:
    settings = {"timeout_s": 2.0, "retries": 1, "backoff_s": 0.05, "batch_size": 2} | settings
    return RemoteScorer(RewardHttpConfig(url=f"http://127.0.0.1:{port}/score", **settings))


ITEMS = [RemoteItem("1+1=", text, "2", {"group_id": "g"}) for text in ("2", "3", "so 2", "22", "2")]


def test_scores_come_back_in_order_across_concurrent_batches(port):
    server = start_server(port, "--token", "s3cret")
    try:
        client = scorer(port, max_concurrency=2)
        client.headers["Authorization"] = "Bearer s3cret"
        assert asyncio.run(client.score(ITEMS)) == [1.0, 0.0, 1.0, 0.0, 1.0]
        client.headers.pop("Authorization")
        with pytest.raises(RemoteRewardRejected, match="HTTP 401"):
            asyncio.run(client.score(ITEMS[:1]))
    finally:
        server.kill()
        server.wait()


def test_a_service_that_is_down_opens_the_breaker_and_is_never_scored_as_zero(port):
    client = scorer(port)

    async def outage_then_recovery() -> list[float]:
        failures = []
        for _ in range(2):  # each try: a request and one retry, both refused
            with pytest.raises(DependencyUnavailable, match="failed 2 times"):
                await client.score(ITEMS[:1])
            failures.append(client.breaker.failures)
        assert failures == [2, 4] and client.breaker.state == BreakerState.OPEN
        with pytest.raises(DependencyUnavailable, match="breaker open"):  # known down: nothing is sent
            await client.score(ITEMS[:1])
        assert client.breaker.failures == 4
        server = start_server(port)
        try:
            client.breaker.cooldown_s = 0.01  # let the half-open probe through now
            await asyncio.sleep(0.02)
            return await client.score(ITEMS[:2])
        finally:
            server.kill()
            server.wait()

    assert asyncio.run(outage_then_recovery()) == [1.0, 0.0]
    assert client.breaker.state == BreakerState.CLOSED and not client.down_logged


def test_a_slow_answer_counts_as_a_failure(port):
    server = start_server(port, "--delay-s", "1.5")
    try:
        with pytest.raises(DependencyUnavailable, match=r"within 0\.5s"):
            asyncio.run(scorer(port, timeout_s=0.5, retries=0).score(ITEMS[:1]))
    finally:
        server.kill()
        server.wait()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "not a JSON object"),
        (b'{"score": [1]}', "not a JSON object with scores"),
        (b'{"scores": [1, 2]}', "expected a list of 1 scores"),
        (b'{"scores": [NaN]}', "finite numbers"),
        (b'{"scores": [true]}', "finite numbers"),
    ],
)
def test_an_answer_that_does_not_fit_the_schema_is_the_services_failure(body, reason):
    with pytest.raises(_RequestFailed, match=reason) as failure:
        parse_scores(body, 1)
    assert failure.value.kind == "malformed"
    assert parse_scores(b'{"scores": [0.5]}', 1) == [0.5]


class ScriptedService:
    """A real HTTP server on a real socket answering each POST with the next status of ``script`` (then 200 with
    ``ok_body``) after ``hold_s``, recording when each request came and the most it held at once."""

    def __init__(self, script: list[int], ok_body: bytes = b'{"scores": [1.0]}', hold_s: float = 0.0):
        import http.server
        import threading
        import time

        self.script, self.times = list(script), []
        self.active = self.peak = 0
        lock = threading.Lock()
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    service.times.append(time.monotonic())
                    service.active += 1
                    service.peak = max(service.peak, service.active)
                time.sleep(hold_s)
                with lock:
                    service.active -= 1
                status = service.script.pop(0) if service.script else 200
                body = ok_body if status == 200 else b'{"error": "scripted"}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status", [500, 503, 408, 429])
def test_a_failing_status_is_retried_with_doubling_backoff_and_then_the_service_is_down(status):
    service = ScriptedService([status] * 3)
    try:
        with pytest.raises(DependencyUnavailable, match=f"failed 3 times: HTTP {status}"):
            asyncio.run(scorer(service.port, retries=2, backoff_s=0.2).score(ITEMS[:1]))
        assert len(service.times) == 3  # the request and its two retries, no more
        first_wait, second_wait = (b - a for a, b in itertools.pairwise(service.times))
        assert first_wait >= 0.2 and second_wait >= 0.4  # backoff_s, then twice it
        assert asyncio.run(scorer(service.port).score(ITEMS[:1])) == [1.0]  # the service answers again
    finally:
        service.close()


def test_a_failure_then_an_answer_is_scored_by_the_retry():
    service = ScriptedService([503])
    try:
        assert asyncio.run(scorer(service.port, retries=1).score(ITEMS[:1])) == [1.0]
        assert len(service.times) == 2
    finally:
        service.close()


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_a_client_error_blames_the_input_and_is_not_retried(status):
    service = ScriptedService([status])
    try:
        client = scorer(service.port, retries=3)
        with pytest.raises(RemoteRewardRejected, match=f"HTTP {status} from"):
            asyncio.run(client.score(ITEMS[:1]))
        assert len(service.times) == 1
        assert client.breaker.failures == 0  # bad input says nothing about the service being down
    finally:
        service.close()


@pytest.mark.parametrize("limit", [2, 3])
def test_requests_in_flight_reach_max_concurrency_and_never_exceed_it(limit):
    # Six one-item batches, each held 0.3 s by the service: all six would be in flight at once without the limit.
    service = ScriptedService([], hold_s=0.3)
    try:
        client = RemoteScorer(
            RewardHttpConfig(url=f"http://127.0.0.1:{service.port}/score", batch_size=1, max_concurrency=limit)
        )
        assert asyncio.run(client.score(ITEMS + ITEMS[:1])) == [1.0] * 6
        assert len(service.times) == 6
        assert service.peak == limit
    finally:
        service.close()
