"""Elastic stage replicas (`rlpipe scale ROLE N`): which replicas a count starts and stops, which requests are refused,
and how the launcher's scaler carries a request out. The whole path in a live run is tests/test_elastic.py."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

import pytest
from rich.console import Console

from services.cli.launch.children import Child
from services.cli.launch.scaling import ReplicaScaler, ScalePlan, plan_scale
from services.common.config import SupervisionConfig
from services.common.observe.events import EventLog
from services.common.transport.scale import ScaledElsewhere, ScaleRecord, ScaleRefused, check_scale

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("members", "retiring", "target", "plan"),
    [
        (["rollout-0"], [], 3, ScalePlan(start=("rollout-1", "rollout-2"))),
        (["rollout-0", "rollout-1", "rollout-2"], [], 1, ScalePlan(stop=("rollout-2", "rollout-1"))),
        (["rollout-0", "rollout-1", "rollout-2"], [], 3, ScalePlan()),
        (["rollout-0", "rollout-1", "rollout-10", "rollout-2"], [], 2, ScalePlan(stop=("rollout-10", "rollout-2"))),
        (["rollout-0"], [], 0, ScalePlan(stop=("rollout-0",))),
        ([], [], 2, ScalePlan(start=("rollout-0", "rollout-1"))),
        # A name still draining is started again only once its process has gone.
        (["rollout-0"], ["rollout-2"], 3, ScalePlan(start=("rollout-1",))),
        # A gap is filled and what is above the count goes.
        (["rollout-0", "rollout-2"], [], 2, ScalePlan(start=("rollout-1",), stop=("rollout-2",))),
        # A name outside the scheme does not count toward the role and is stopped first.
        (["rollout-0", "rollout-extra"], [], 2, ScalePlan(start=("rollout-1",), stop=("rollout-extra",))),
    ],
)
def test_a_count_starts_the_missing_names_below_it_and_stops_the_highest_numbered_above_it_first(
    members, retiring, target, plan
):
    assert plan_scale("rollout", members, retiring, target) == plan


LAUNCHED = SupervisionConfig(scaler="launcher", max_replicas=16)


@pytest.mark.parametrize(
    ("role", "replicas", "says"),
    [
        ("rollout", -1, "-1 replicas: a count is 0 or more"),
        ("rollout", 17, "17 rollout replicas is more than supervision.max_replicas (16)"),
        ("critic", 2, "unknown role 'critic': one of rollout, reward, reference"),
        ("trainer", 2, "the trainer does not scale: a run has one trainer, fenced by its lease"),
        ("trainer", 1, "the trainer does not scale"),
    ],
)
def test_a_bad_scale_request_is_refused_naming_why(role, replicas, says):
    with pytest.raises(ScaleRefused) as refused:
        check_scale(role, replicas, LAUNCHED)
    assert says in str(refused.value)
    assert not isinstance(refused.value, ScaledElsewhere)


@pytest.mark.parametrize(("role", "replicas"), [("rollout", 0), ("reward", 16), ("reference", 3)])
def test_a_stage_role_may_be_scaled_from_zero_to_the_cap_in_a_local_run(role, replicas):
    check_scale(role, replicas, LAUNCHED)


def test_where_an_orchestrator_runs_the_replicas_a_scale_request_says_where_to_scale_instead():
    with pytest.raises(ScaledElsewhere) as refused:
        check_scale("rollout", 3, SupervisionConfig())  # scaler: orchestrator, the default outside `rlpipe run`
    message = str(refused.value)
    assert "supervision.scaler: orchestrator" in message
    assert "kubectl scale deployment/rollout --replicas=3" in message and "--scale rollout=3" in message


def test_a_deterministic_run_keeps_one_replica_of_each_role():
    with pytest.raises(ScaleRefused, match="a reproducible run has one replica of each role"):
        check_scale("rollout", 2, LAUNCHED, deterministic=True)
    check_scale("rollout", 1, LAUNCHED, deterministic=True)
    check_scale("rollout", 0, LAUNCHED, deterministic=True)


class FakeProcess:
    """What the scaler asks of a replica's process: whether it runs, a signal, a kill."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)

    def kill(self) -> None:
        self.signals.append(signal.SIGKILL)
        self.returncode = -signal.SIGKILL


def replica(name: str, tmp_path: Path) -> Child:
    role = name.rpartition("-")[0]
    return Child(name, role, FakeProcess(len(name)), tmp_path / f"{name}.log", 2**20, 1)  # type: ignore[arg-type]


@pytest.fixture
def scaler(tmp_path) -> ReplicaScaler:
    started = {"rollout": 1, "reward": 1, "reference": 1}
    return ReplicaScaler(started, EventLog(tmp_path / "events.jsonl"), Console(file=io.StringIO()))


def test_the_scaler_starts_replicas_for_a_request_then_drains_the_highest_and_never_restarts_them(scaler, tmp_path):
    children = [replica(name, tmp_path) for name in ("trainer-x", "rollout-0", "reward-0", "reference-0")]

    step = scaler.follow({"rollout": ScaleRecord("rollout", 3, "alice", 1.0, revision=1)}, children, 20.0)
    assert step.start == [("rollout", "rollout-1"), ("rollout", "rollout-2")] and not step.gone
    children += [replica("rollout-1", tmp_path), replica("rollout-2", tmp_path)]
    # The same request read again starts nothing more.
    assert scaler.follow({"rollout": ScaleRecord("rollout", 3, "alice", 1.0, 1)}, children, 20.0).start == []

    down = {"rollout": ScaleRecord("rollout", 1, "bob", 2.0, revision=2)}
    step = scaler.follow(down, children, 20.0)
    removed = [c for c in children if c.name in ("rollout-1", "rollout-2")]
    assert step.start == [] and step.gone == []
    assert [c.process.signals for c in removed] == [[signal.SIGTERM], [signal.SIGTERM]]
    assert not scaler.wanted("rollout-1") and not scaler.wanted("rollout-2") and scaler.wanted("rollout-0")

    # rollout-2 drains and exits; the launcher may drop it and forget its presence entry, and starts nothing.
    removed[1].process.returncode = 0
    step = scaler.follow(down, children, 20.0)
    assert step.gone == [removed[1]] and step.start == []
    forgotten: list[tuple[str, str]] = []
    scaler.forget_departed(lambda role, name: forgotten.append((role, name)) is None)
    assert forgotten == [("rollout", "rollout-2")] and not scaler.departed
    children.remove(removed[1])

    # rollout-1 outlives its stop grace: killed, then gone. Its unacked messages come back after the ack wait.
    scaler.retiring["rollout-1"].kill_at = 0.0
    step = scaler.follow(down, children, 20.0)
    assert removed[0].process.signals == [signal.SIGTERM, signal.SIGKILL] and step.gone == [removed[0]]

    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["role"], e["before"], e["after"], e["author"]) for e in events] == [
        ("scaled", "rollout", 1, 3, "alice"),
        ("scaled", "rollout", 3, 1, "bob"),
    ]


def test_a_presence_entry_that_cannot_be_deleted_now_is_tried_again_later(scaler, monkeypatch):
    scaler.departed = {"rollout-2": "rollout"}
    clock = [100.0]
    monkeypatch.setattr("services.cli.launch.scaling.time.monotonic", lambda: clock[0])
    tries: list[str] = []

    def broker_away(role: str, name: str) -> bool:
        tries.append(name)
        return False

    scaler.forget_departed(broker_away)
    scaler.forget_departed(broker_away)  # at once: not tried again yet
    assert tries == ["rollout-2"] and scaler.departed == {"rollout-2": "rollout"}
    clock[0] += 11.0
    scaler.forget_departed(lambda role, name: True)
    assert scaler.departed == {}
