"""The remote reward client against the reference server, a real process on a real socket."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import logging
import socket
import ssl
import urllib.error

import pytest

from services.common.config import RewardHttpConfig
from services.common.transport.breaker import BreakerState, DependencyRefused, DependencyUnavailable
from services.common.transport.http_dependency import Fault, RequestFailed, judge_error
from services.reward.remote import RemoteItem, RemoteRewardRejected, RemoteScorer, judge_status, parse_scores
from tests.support.servers import RedirectingService, free_port, start_reward_server

pytestmark = pytest.mark.integration


@pytest.fixture
def port():
    return free_port()


def scorer(port: int, **settings) -> RemoteScorer:
    settings = {"timeout_s": 2.0, "retries": 1, "backoff_s": 0.05, "batch_size": 2} | settings
    return RemoteScorer(RewardHttpConfig(url=f"http://127.0.0.1:{port}/score", **settings))


ITEMS = [RemoteItem("1+1=", text, "2", {"group_id": "g"}) for text in ("2", "3", "so 2", "22", "2")]


def test_scores_come_back_in_order_across_concurrent_batches(port):
    server = start_reward_server(port, "--token", "s3cret")
    try:
        client = scorer(port, max_concurrency=2)
        client.headers["Authorization"] = "Bearer s3cret"
        assert asyncio.run(client.score(ITEMS)) == [1.0, 0.0, 1.0, 0.0, 1.0]
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
        server = start_reward_server(port)
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
    server = start_reward_server(port, "--delay-s", "1.5")
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
    with pytest.raises(RequestFailed, match=reason) as failure:
        parse_scores(body, 1)
    assert failure.value.kind == "malformed"
    assert parse_scores(b'{"scores": [0.5]}', 1) == [0.5]


class ScriptedService:
    """A real HTTP server on a real socket answering each POST with the next status of ``script`` (then 200 with
    ``ok_body``) after ``hold_s``, recording when each request came and the most it held at once; with
    ``echo_authorization`` a failing answer quotes the request's Authorization header back."""

    def __init__(
        self,
        script: list[int],
        ok_body: bytes = b'{"scores": [1.0]}',
        hold_s: float = 0.0,
        echo_authorization: bool = False,
    ):
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
                if status != 200 and echo_authorization:  # as some services do: "invalid token <the token>"
                    body = json.dumps({"error": f"invalid {self.headers.get('Authorization')}"}).encode()
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


@pytest.mark.parametrize("status", [400, 422])
def test_a_400_or_422_with_a_reason_blames_the_input_and_is_not_retried(status):
    service = ScriptedService([status])
    try:
        client = scorer(service.port, retries=3)
        with pytest.raises(RemoteRewardRejected, match=f"HTTP {status} from .*: scripted$"):
            asyncio.run(client.score(ITEMS[:1]))
        assert len(service.times) == 1
        assert client.breaker.failures == 0  # bad input says nothing about the service being down
    finally:
        service.close()


def everything_logged(caplog) -> str:
    """Every record's event and fields, as the JSON log lines would carry them."""
    return "\n".join(json.dumps([r.getMessage(), getattr(r, "fields", {})], default=str) for r in caplog.records)


def alerts(caplog) -> list[dict]:
    return [getattr(r, "fields", {}) | {"event": r.getMessage()} for r in caplog.records if r.levelname == "ERROR"]


@pytest.mark.parametrize("status", [401, 403, 404, 405, 413])
def test_an_auth_or_routing_error_is_the_services_outage_opened_at_once_and_alerted_by_status(status, caplog):
    service = ScriptedService([status])
    try:
        client = scorer(service.port, retries=3)
        with pytest.raises(DependencyUnavailable, match=f"misconfigured or broken: HTTP {status} from"):
            asyncio.run(client.score(ITEMS[:1]))
        assert len(service.times) == 1  # the same request again would meet the same answer
        assert client.breaker.state == BreakerState.OPEN and client.breaker.failures == 1
        [alert] = alerts(caplog)
        assert alert["event"] == "reward_service_down" and alert["alert"] is True
        assert alert["kind"] == f"http_{status}" and f"HTTP {status}" in alert["error"]
        with pytest.raises(DependencyUnavailable, match="breaker open"):  # the groups wait; nothing is sent
            asyncio.run(client.score(ITEMS[:1]))
        assert len(service.times) == 1
    finally:
        service.close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_so_the_token_never_reaches_another_host(status, tmp_path):
    service = RedirectingService(status)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    try:
        client = scorer(service.port, token_file=str(token_file))
        redirected = f"HTTP {status} .*redirects to 'http://localhost:.*not followed"
        with pytest.raises(DependencyUnavailable, match=redirected):
            asyncio.run(client.score(ITEMS[:1]))
        assert service.reached == []
        assert client.breaker.state == BreakerState.OPEN
    finally:
        service.close()


def test_an_answer_over_max_response_bytes_is_the_services_outage_and_is_not_read_whole(caplog):
    service = ScriptedService([], ok_body=b'{"scores": [1.0], "padding": "' + b"x" * 5000 + b'"}')
    try:
        client = scorer(service.port, retries=2, max_response_bytes=4096)
        with pytest.raises(DependencyUnavailable, match=r"over reward.http.max_response_bytes=4096"):
            asyncio.run(client.score(ITEMS[:1]))
        assert len(service.times) == 1 and client.breaker.state == BreakerState.OPEN
        assert [alert["kind"] for alert in alerts(caplog)] == ["oversized"]
        assert asyncio.run(scorer(service.port, max_response_bytes=8192).score(ITEMS[:1])) == [1.0]
    finally:
        service.close()


def test_the_token_file_is_read_before_each_batch_so_a_rewritten_token_is_used(port, tmp_path):
    server = start_reward_server(port, "--token", "right")
    token_file = tmp_path / "token"
    token_file.write_text("wrong")
    try:
        client = scorer(port, token_file=str(token_file))
        with pytest.raises(DependencyUnavailable, match="HTTP 401"):
            asyncio.run(client.score(ITEMS[:1]))
        token_file.write_text("right\n")
        client.breaker.succeeded()  # past its cool-down
        assert asyncio.run(client.score(ITEMS[:2])) == [1.0, 0.0]
        token_file.write_text("")
        with pytest.raises(DependencyRefused, match=r"token_file: the token in .* is empty") as refused:
            asyncio.run(client.score(ITEMS[:1]))
        assert refused.value.kind == "token" and client.breaker.state == BreakerState.OPEN
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize(
    "rotated",
    ["right\nLEAKED-second-line\n", "LEAKED-t\u00f6ken", "LEAKED-\u4e2d\u6587", "LEAKED\x7fdel", "\n"],
)
def test_a_token_rotated_to_one_that_cannot_be_sent_is_refused_unsent_and_never_quoted(rotated, tmp_path, caplog):
    """Before the check, http.client refused the header with 'Invalid header value b'Bearer right\\nLEAKED...'', a
    ValueError the stage took for the input's fault (each group dead-lettered, the token in the reason)."""
    caplog.set_level(logging.DEBUG)
    service = ScriptedService([])
    token_file = tmp_path / "token"
    token_file.write_text("right\n")
    try:
        client = scorer(service.port, token_file=str(token_file))
        assert asyncio.run(client.score(ITEMS[:1])) == [1.0]
        token_file.write_text(rotated, encoding="utf-8")
        with pytest.raises(DependencyRefused, match=r"reward.http.token_file: the token in '.*/token' ") as refused:
            asyncio.run(client.score(ITEMS[:1]))
        assert refused.value.kind == "token" and len(service.times) == 1  # nothing was sent with it
        [alert] = alerts(caplog)
        assert (alert["event"], alert["kind"]) == ("reward_service_down", "token")
        said = str(refused.value) + repr(refused.value) + everything_logged(caplog)
        assert "LEAKED" not in said and "right" not in said
    finally:
        service.close()


def test_a_header_that_cannot_be_sent_is_a_refusal_whose_reason_does_not_quote_it(caplog):
    """A header from the environment is checked at start; one that still cannot be sent (http.client raises a
    ValueError quoting it) is refused without its value."""
    service = ScriptedService([])
    try:
        client = scorer(service.port)
        client.headers["X-Api-Key"] = "LEAKED-key\nX-Injected: 1"
        with pytest.raises(DependencyRefused, match=r"a request header .* cannot be sent") as refused:
            asyncio.run(client.score(ITEMS[:1]))
        assert refused.value.kind == "header" and service.times == []
        assert "LEAKED" not in str(refused.value) + everything_logged(caplog)
    finally:
        service.close()


def test_a_service_that_echoes_the_token_in_its_refusal_has_it_replaced_before_it_is_quoted(tmp_path, caplog):
    service = ScriptedService([401], echo_authorization=True)
    token_file = tmp_path / "token"
    token_file.write_text("LEAKED-echoed-token\n")
    try:
        client = scorer(service.port, token_file=str(token_file))
        with pytest.raises(DependencyRefused, match="HTTP 401") as refused:
            asyncio.run(client.score(ITEMS[:1]))
        [alert] = alerts(caplog)
        assert "<redacted>" in alert["error"] and "<redacted>" in str(refused.value)
        assert "LEAKED" not in str(refused.value) + everything_logged(caplog)
    finally:
        service.close()


@pytest.mark.parametrize(
    ("status", "body", "fault"),
    [
        (400, b'{"error": "items[0] has no completion"}', Fault.INPUT),
        (422, b'{"error": "answer is not a number"}', Fault.INPUT),
        (400, b"<html>Bad Request</html>", Fault.PERSISTENT),  # a proxy's or another service's page: no reason
        (422, b'{"error": ""}', Fault.PERSISTENT),
        (401, b'{"error": "token expired"}', Fault.PERSISTENT),
        (403, b"", Fault.PERSISTENT),
        (404, b'{"error": "no such path"}', Fault.PERSISTENT),
        (405, b"", Fault.PERSISTENT),
        (302, b"", Fault.PERSISTENT),
        (413, b'{"error": "too large"}', Fault.PERSISTENT),
        (408, b"", Fault.TRANSIENT),
        (429, b"", Fault.TRANSIENT),
        (500, b'{"error": "boom"}', Fault.TRANSIENT),
        (503, b"", Fault.TRANSIENT),
    ],
)
def test_only_a_400_or_422_stating_a_reason_blames_the_input(status, body, fault):
    verdict = judge_status(status, body, "http://rm/score", location="http://elsewhere/")
    assert (verdict.fault, verdict.kind) == (fault, f"http_{status}")
    if fault == Fault.INPUT:
        assert verdict.reason == f"HTTP {status} from http://rm/score: {json.loads(body)['error']}"


@pytest.mark.parametrize(
    ("error", "fault", "kind"),
    [
        (urllib.error.URLError(ssl.SSLCertVerificationError(1, "certificate verify failed")), Fault.PERSISTENT, "tls"),
        (ssl.SSLError(1, "wrong version number"), Fault.PERSISTENT, "tls"),
        (urllib.error.URLError(socket.gaierror(-2, "Name or service not known")), Fault.PERSISTENT, "dns"),
        (urllib.error.URLError(ConnectionRefusedError(111, "refused")), Fault.TRANSIENT, "connection"),
        (urllib.error.URLError(TimeoutError("timed out")), Fault.TRANSIENT, "timeout"),
        (TimeoutError("timed out"), Fault.TRANSIENT, "timeout"),
        (ConnectionResetError(104, "reset"), Fault.TRANSIENT, "connection"),
        (http.client.RemoteDisconnected("closed"), Fault.TRANSIENT, "connection"),
    ],
)
def test_a_request_without_an_answer_is_the_services_outage_tls_and_dns_persistent(error, fault, kind):
    verdict = judge_error(error, "https://rm/score", 2.0)
    assert (verdict.fault, verdict.kind) == (fault, kind)
    assert "https://rm/score" in verdict.reason


def test_a_tls_failure_against_a_real_socket_is_a_persistent_outage(port):
    server = start_reward_server(port)  # plain HTTP: the TLS handshake fails
    try:
        client = RemoteScorer(RewardHttpConfig(url=f"https://127.0.0.1:{port}/score", retries=3))
        with pytest.raises(DependencyUnavailable, match=r"TLS with https://127\.0\.0\.1"):
            asyncio.run(client.score(ITEMS[:1]))
        assert client.breaker.state == BreakerState.OPEN and client.breaker.failures == 1
    finally:
        server.kill()
        server.wait()


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
