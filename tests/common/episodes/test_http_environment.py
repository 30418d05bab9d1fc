"""The HTTP environment client against a real HTTP server on a real socket: the reference
environment server, and the same server made to misbehave (slow, failing, off the schema, gone)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from services.common.config import RolloutConfig
from services.common.episodes.environments import Calculator, EnvironmentFailed, StepResult, Task, Turn
from services.common.episodes.episode_state import EpisodeLimits, EpisodeState
from services.common.episodes.http_environment import HttpEnvironmentClient
from services.common.episodes.observations import VerbatimObservations
from services.common.episodes.runner import run_episodes, start_episodes
from services.common.transport.breaker import BreakerState, DependencyRefused, DependencyUnavailable
from services.common.transport.http_dependency import BREAKER_COOLDOWN_S, BREAKER_THRESHOLD
from services.rollout.environment_server import EnvironmentHandler, EnvironmentServer
from tests.support.episodes import CharTokenizer, ScriptedEngine
from tests.support.servers import RedirectingService, free_port

pytestmark = pytest.mark.integration

TASK = Task("p0", "Q: 12*34=", "408")
CALL = Turn("<calc>12*34</calc>", (1, 2, 3))


class Misbehaving(EnvironmentHandler):
    """The reference handler, unless the server's ``mode`` says to misbehave; counts the requests it gets."""

    def do_POST(self) -> None:
        self.server.requests += 1
        mode = self.server.mode
        if mode == "ok":
            super().do_POST()
        elif mode == "slow":
            time.sleep(1.0)  # the slow environment under test: past the client's timeout
            super().do_POST()
        elif mode == "garbage":
            self.send_response(200)
            self.send_header("Content-Length", "8")
            self.end_headers()
            self.wfile.write(b"not json")
        else:
            self.answer(int(mode), {"error": f"told to answer {mode}"})


@pytest.fixture
def server() -> Iterator[EnvironmentServer]:
    server = EnvironmentServer(free_port(), Calculator, handler=Misbehaving)
    server.mode, server.requests = "ok", 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def client_of(server: EnvironmentServer, **settings) -> HttpEnvironmentClient:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    return HttpEnvironmentClient(RolloutConfig(environment_url=url, **({"environment_timeout_s": 0.5} | settings)))


def alerts(caplog) -> list[dict]:
    return [getattr(r, "fields", {}) | {"event": r.getMessage()} for r in caplog.records if r.levelname == "ERROR"]


def test_an_http_environment_runs_an_episode_as_the_local_one_would(server):
    async def episode() -> tuple[str, StepResult, StepResult]:
        environment = client_of(server).episode()
        prompt = await environment.reset(TASK)
        return prompt, await environment.step(CALL), await environment.step(Turn("It is 408.", (4,)))

    prompt, call, answer = asyncio.run(episode())
    assert prompt == TASK.prompt
    assert call == StepResult(observation="<result>408</result>", tool_call=True)
    assert answer == StepResult(done=True)
    assert server.episodes == {}  # the episode ended: the server forgot it


def test_an_episode_the_client_ends_itself_is_closed_on_the_service_and_one_the_service_ended_is_not(server):
    tokenizer = CharTokenizer()
    client = client_of(server)
    # The model calls the tool at every turn: max_turns ends both episodes, the service never says done.
    engine = ScriptedEngine(["<calc>1+1</calc>"], tokenizer)

    async def episodes() -> list[EpisodeState]:
        [group] = await start_episodes([TASK], client.episode, 2, tokenizer)
        assert len(server.episodes) == 2
        await run_episodes(
            group, engine.generate, EpisodeLimits(2, 20, 80, 40, 400), tokenizer, VerbatimObservations(tokenizer)
        )
        return group

    group = asyncio.run(episodes())
    assert [state.outcome for state in group] == ["max_turns", "max_turns"]
    deadline = time.monotonic() + 10.0  # each told to /close once, in the background
    while server.episodes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.episodes == {}
    requests = server.requests
    # Ended by the service (done), an episode is not closed again: no request is sent.
    environment = client.episode()
    asyncio.run(environment.reset(TASK))
    asyncio.run(environment.step(Turn("It is 408.", (4,))))
    asyncio.run(environment.close())
    assert server.requests == requests + 2 and server.episodes == {}


def test_a_slow_environment_ends_the_episode_as_timeout_after_its_retries(server):
    client = client_of(server, environment_retries=1)
    environment = client.episode()
    asyncio.run(environment.reset(TASK))
    server.mode, server.requests = "slow", 0
    with pytest.raises(EnvironmentFailed, match=r"within 0\.5s") as failed:
        asyncio.run(environment.step(CALL))
    assert (failed.value.outcome, server.requests, client.breaker.failures) == ("timeout", 2, 2)


def test_an_environment_that_keeps_failing_opens_the_breaker_alerts_and_is_left_alone_until_it_recovers(server, caplog):
    caplog.set_level(logging.INFO)
    client = client_of(server, environment_retries=0)
    environment = client.episode()
    asyncio.run(environment.reset(TASK))
    server.mode, server.requests = "503", 0
    for _ in range(BREAKER_THRESHOLD):
        with pytest.raises(EnvironmentFailed, match="answered 503") as failed:
            asyncio.run(environment.step(CALL))
        assert failed.value.outcome == "env_error"
    assert client.breaker.state == BreakerState.OPEN
    [alert] = alerts(caplog)
    assert (alert["event"], alert["alert"], alert["kind"]) == ("environment_service_down", True, "http_503")
    with pytest.raises(EnvironmentFailed, match="breaker open"):  # known down: nothing is sent
        asyncio.run(environment.step(CALL))
    assert server.requests == BREAKER_THRESHOLD
    server.mode = "ok"
    client.breaker.clock = lambda: time.monotonic() + BREAKER_COOLDOWN_S  # the cool-down has passed
    assert asyncio.run(environment.step(CALL)).observation == "<result>408</result>"
    assert client.breaker.state == BreakerState.CLOSED
    assert "environment_service_recovered" in [r.getMessage() for r in caplog.records]


def test_a_misrouted_environment_opens_the_breaker_at_once(server, caplog):
    client = client_of(server)
    server.mode = "404"
    with pytest.raises(EnvironmentFailed, match="answered 404") as failed:
        asyncio.run(client.episode().reset(TASK))
    assert failed.value.refused == "http_404"
    assert (server.requests, client.breaker.state) == (1, BreakerState.OPEN)
    assert [alert["event"] for alert in alerts(caplog)] == ["environment_service_down"]


@pytest.mark.parametrize(("mode", "refused"), [("403", DependencyRefused), ("503", DependencyUnavailable)])
def test_a_reset_the_environment_refuses_holds_the_batch_as_a_refusal_and_an_outage_as_an_outage(server, mode, refused):
    """A refusal (here 403) reaches the stage as DependencyRefused, which alerts at once; a 503 is a passing
    outage, which the stage waits out before alerting."""
    client = client_of(server, environment_retries=0)
    server.mode = mode
    with pytest.raises(DependencyUnavailable, match=f"reset failed .*answered {mode}") as held:
        asyncio.run(start_episodes([TASK], client.episode, 1, CharTokenizer()))
    assert type(held.value) is refused
    if refused is DependencyRefused:
        assert held.value.kind == f"http_{mode}"


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_so_no_prompt_reaches_the_host_it_names_and_the_breaker_opens_at_once(status, caplog):
    service = RedirectingService(status)
    try:
        client = HttpEnvironmentClient(
            RolloutConfig(environment_url=f"http://127.0.0.1:{service.port}", environment_timeout_s=0.5)
        )
        refused = f"answered {status} to 'http://localhost:.*not followed: set rollout.environment_url"
        with pytest.raises(EnvironmentFailed, match=refused) as failed:
            asyncio.run(client.episode().reset(TASK))
        assert failed.value.outcome == "env_error"
        assert service.reached == []  # urllib alone follows 301, 302 and 303 there as a GET
        assert client.breaker.state == BreakerState.OPEN
        [alert] = alerts(caplog)
        assert (alert["event"], alert["kind"]) == ("environment_service_down", f"http_{status}")
    finally:
        service.close()


def test_a_rejected_turn_ends_only_its_episode_and_leaves_the_breaker_closed(server):
    client = client_of(server)
    environment = client.episode()
    asyncio.run(environment.reset(TASK))
    server.mode, server.requests = "422", 0
    with pytest.raises(EnvironmentFailed, match="rejected the turn with 422"):
        asyncio.run(environment.step(CALL))
    assert (server.requests, client.breaker.state, client.breaker.failures) == (1, BreakerState.CLOSED, 0)


def test_an_answer_off_the_schema_is_retried_then_ends_the_episode_as_env_error(server):
    client = client_of(server, environment_retries=1)
    environment = client.episode()
    asyncio.run(environment.reset(TASK))
    server.mode, server.requests = "garbage", 0
    with pytest.raises(EnvironmentFailed, match="is not JSON") as failed:
        asyncio.run(environment.step(CALL))
    assert (failed.value.outcome, server.requests) == ("env_error", 2)


def test_a_step_for_an_episode_the_server_does_not_know_is_rejected_not_retried(server):
    client = client_of(server)
    with pytest.raises(EnvironmentFailed, match="rejected the turn with 400"):
        asyncio.run(client.episode().step(CALL))
    assert server.requests == 1


class SeededPuzzle(Calculator):
    """Needs its row's info to start: the puzzle's seed and level, written into the first prompt."""

    def reset(self, task: Task) -> str:
        return f"{task.prompt} [seed {task.info['seed']}, level {task.info['level']['name']}]"


def test_a_rows_info_reaches_the_reset_of_a_served_environment_as_of_a_local_one():
    task = Task("p1", "Solve:", "7", info={"seed": 42, "level": {"name": "hard"}})
    server = EnvironmentServer(free_port(), SeededPuzzle)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        served = asyncio.run(client_of(server).episode().reset(task))
    finally:
        server.shutdown()
    assert served == SeededPuzzle().reset(task) == "Solve: [seed 42, level hard]"
