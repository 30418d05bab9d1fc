"""The decisions of the HTTP dependency guard that the remote reward and the HTTP environment share: which failures
are retried, which open the breaker at once, which leave it alone, and what is logged when it opens and closes.
Requests here are plain functions that raise or answer as scripted: no socket (the clients' own tests use one)."""

from __future__ import annotations

import asyncio
import http.client
import logging
import socket
import ssl
import urllib.error

import pytest

from services.common.observe.events import Event
from services.common.transport.breaker import BreakerState
from services.common.transport.http_dependency import (
    BreakerOpen,
    DependencyEvents,
    Fault,
    HttpDependency,
    RequestFailed,
    Verdict,
    fault_of_status,
    judge_error,
)

pytestmark = pytest.mark.unit

EVENTS = DependencyEvents(Event.REWARD_REQUEST_FAILED, Event.REWARD_SERVICE_DOWN, Event.REWARD_SERVICE_RECOVERED)
THRESHOLD = 3


def dependency() -> HttpDependency:
    return HttpDependency("http://svc/x", "the test service", "rlpipe_test_http", EVENTS, 0.001, THRESHOLD, 5.0)


class Scripted:
    """A request that fails with each verdict of ``script`` in turn, then answers "ok"; counts its calls."""

    def __init__(self, *script: Verdict):
        self.script = list(script)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.script:
            raise RequestFailed(self.script.pop(0))
        return "ok"


DOWN = Verdict(Fault.TRANSIENT, "connection", "refused")
WRONG = Verdict(Fault.PERSISTENT, "http_404", "no such path")
REFUSED = Verdict(Fault.INPUT, "http_422", "no answer field")


def events(caplog) -> list[tuple[str, str]]:
    return [(r.getMessage(), r.levelname) for r in caplog.records]


@pytest.mark.parametrize(
    ("status", "fault"),
    [(status, Fault.INPUT) for status in (400, 422)]
    + [(status, Fault.TRANSIENT) for status in (408, 429, 500, 503)]
    + [(status, Fault.PERSISTENT) for status in (302, 401, 403, 404, 405, 413)],
)
def test_a_status_is_the_inputs_fault_only_for_400_and_422_and_an_outage_for_5xx_408_and_429(status, fault):
    assert fault_of_status(status) == fault


@pytest.mark.parametrize(
    ("error", "fault", "kind"),
    [
        (urllib.error.URLError(TimeoutError("timed out")), Fault.TRANSIENT, "timeout"),
        (urllib.error.URLError(ConnectionRefusedError(111, "refused")), Fault.TRANSIENT, "connection"),
        (http.client.RemoteDisconnected("closed"), Fault.TRANSIENT, "connection"),
        (urllib.error.URLError(ssl.SSLCertVerificationError(1, "certificate verify failed")), Fault.PERSISTENT, "tls"),
        (urllib.error.URLError(socket.gaierror(-2, "Name or service not known")), Fault.PERSISTENT, "dns"),
    ],
)
def test_no_answer_is_an_outage_retried_unless_tls_or_dns_say_the_address_is_wrong(error, fault, kind):
    verdict = judge_error(error, "https://svc/x", 0.5)
    assert (verdict.fault, verdict.kind) == (fault, kind)
    assert "https://svc/x" in verdict.reason


def test_a_transient_failure_is_retried_and_the_retry_answers():
    guard, request = dependency(), Scripted(DOWN)
    assert asyncio.run(guard.call(request, retries=1)) == "ok"
    assert request.calls == 2
    assert (guard.breaker.state, guard.breaker.failures) == (BreakerState.CLOSED, 0)


def test_transient_failures_past_the_retries_raise_the_last_with_its_attempts_and_open_the_breaker_at_threshold(
    caplog,
):
    guard, request = dependency(), Scripted(DOWN, DOWN, DOWN)
    with pytest.raises(RequestFailed, match="refused") as failed:
        asyncio.run(guard.call(request, retries=2))
    assert (failed.value.attempts, failed.value.fault, request.calls) == (3, Fault.TRANSIENT, 3)
    assert (guard.breaker.state, guard.breaker.failures) == (BreakerState.OPEN, THRESHOLD)
    assert events(caplog) == [("reward_request_failed", "WARNING")] * 3 + [("reward_service_down", "ERROR")]
    with pytest.raises(BreakerOpen, match=r"the test service http://svc/x is down \(breaker open"):
        asyncio.run(guard.call(request, retries=2))
    assert request.calls == 3  # known down: nothing was sent


def test_fewer_transient_failures_than_the_threshold_leave_the_breaker_closed_and_log_no_outage(caplog):
    guard = dependency()
    with pytest.raises(RequestFailed):
        asyncio.run(guard.call(Scripted(DOWN, DOWN), retries=1))
    assert (guard.breaker.state, guard.breaker.failures, guard.down_logged) == (BreakerState.CLOSED, 2, False)
    assert [message for message, _ in events(caplog)] == ["reward_request_failed"] * 2


def test_a_persistent_failure_is_not_retried_and_opens_the_breaker_at_once_with_one_alert(caplog):
    guard, request = dependency(), Scripted(WRONG)
    with pytest.raises(RequestFailed, match="no such path") as failed:
        asyncio.run(guard.call(request, retries=3))
    assert (failed.value.attempts, request.calls) == (1, 1)
    assert (guard.breaker.state, guard.breaker.failures) == (BreakerState.OPEN, 1)
    [down] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert (down.getMessage(), down.fields["alert"], down.fields["kind"]) == ("reward_service_down", True, "http_404")


def test_an_input_refusal_is_not_retried_and_leaves_the_breaker_alone(caplog):
    guard, request = dependency(), Scripted(REFUSED)
    with pytest.raises(RequestFailed, match="no answer field") as failed:
        asyncio.run(guard.call(request, retries=3))
    assert (failed.value.fault, failed.value.attempts, request.calls) == (Fault.INPUT, 1, 1)
    assert (guard.breaker.state, guard.breaker.failures, guard.down_logged) == (BreakerState.CLOSED, 0, False)
    assert events(caplog) == [("reward_request_failed", "WARNING")]


def test_the_first_answer_after_an_outage_closes_the_breaker_and_logs_the_recovery_once(caplog):
    caplog.set_level(logging.INFO)
    guard = dependency()
    with pytest.raises(RequestFailed):
        asyncio.run(guard.call(Scripted(WRONG), retries=0))
    guard.breaker.cooldown_s = 1e-9  # the cool-down has passed: the next call is the half-open probe
    assert asyncio.run(guard.call(Scripted(), retries=0)) == "ok"
    assert asyncio.run(guard.call(Scripted(), retries=0)) == "ok"
    assert (guard.breaker.state, guard.breaker.failures, guard.down_logged) == (BreakerState.CLOSED, 0, False)
    assert [message for message, _ in events(caplog)].count("reward_service_recovered") == 1


def test_a_failure_recorded_without_a_request_counts_like_one(caplog):
    guard = dependency()  # an unreadable token: nothing was sent, but the service cannot be asked
    guard.failed(Verdict(Fault.PERSISTENT, "token", "the token file is empty"), 0.0)
    assert (guard.breaker.state, guard.down_logged) == (BreakerState.OPEN, True)
    assert [message for message, _ in events(caplog)] == ["reward_request_failed", "reward_service_down"]


def test_the_events_of_a_dependency_are_members_of_the_event_enum_never_free_strings():
    with pytest.raises(TypeError, match="takes members of Event"):
        DependencyEvents(Event.REWARD_REQUEST_FAILED, "reward_down", Event.REWARD_SERVICE_RECOVERED)  # type: ignore[arg-type]
