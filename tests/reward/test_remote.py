"""The remote reward client against the reference server, a real process on a real socket."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from services.common.bus import BreakerState, DependencyUnavailable
from services.common.config import RewardHttpConfig
from services.reward.remote import RemoteItem, RemoteRewardRejected, RemoteScorer, _RequestFailed, parse_scores
from tests.conftest import free_port, wait_for_port


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
