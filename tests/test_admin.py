"""Operating a live run through the `rlpipe` CLI and the Admin gRPC service of a real pipeline."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import ClassVar

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from safetensors.torch import load_file

from services.common.observe import metrics as m
from services.common.observe.events import Event
from services.common.observe.records import read_events
from services.common.pb import admin_pb2, admin_pb2_grpc
from services.common.transport.weightsync.client import WeightSyncClient
from services.trainer.checkpointing.lineage import Lineage, RestartRecord, effective_steps
from tests.support.runs import config_file, metric_rows, rlpipe, running_pipeline, wait_for
from tests.support.servers import free_port

pytestmark = pytest.mark.e2e


# The operator's own weight-sync token: `rlpipe run` hands the one it finds in its environment to the trainer.
WEIGHT_SYNC_TOKEN = "operator-chosen-token"


async def pull_weights(address: str) -> tuple[int, dict]:
    client = WeightSyncClient(address, token=WEIGHT_SYNC_TOKEN)
    try:
        return await client.pull()
    finally:
        await client.close()


def status(run_dir: Path) -> dict:
    done = rlpipe(run_dir, "status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def start(tiny_model, tmp_path: Path, run_id: str, **sections) -> tuple[Path, Path]:
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id=run_id,
        train={"total_steps": 1000, "batch_size": 8, "learning_rate": 1e-4, "max_inflight_batches": 2},
        checkpoint={"save_every_steps": 2, "keep_last": 20},
        # Operating the run is under test, not the engine: the transformers rollout starts without vLLM's cost.
        rollout={"backend": "hf", "prompts_per_batch": 8},
        supervision={"stop_grace_s": 60},  # a loaded machine can take longer than 20 s to stop a stage
        **sections,
    )
    return config, runs / run_id


def test_operator_controls_a_live_run(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_WEIGHTSYNC_TOKEN", WEIGHT_SYNC_TOKEN)  # read by rlpipe run below, as an operator sets it
    config, run_dir = start(tiny_model, tmp_path, "ops")
    with running_pipeline(config) as process:
        wait_for(lambda: (run_dir / "run.json").exists() and len(metric_rows(run_dir)) > 3, "first steps", process)
        info = json.loads((run_dir / "run.json").read_text())
        assert status(run_dir)["step"] >= 1

        # Without the token nothing is answered; with it, everything is.
        refused = rlpipe(run_dir, "--token", "wrong", "status")
        assert refused.returncode == 4 and "UNAUTHENTICATED" in refused.stderr
        with grpc.insecure_channel(info["admin"]) as channel:
            try:
                admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
                raise AssertionError("a call without a token was answered")
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED

        # The read-only token rlpipe run wrote beside admin.token reads the run and changes nothing.
        assert (run_dir / "admin-read.token").stat().st_mode & 0o777 == 0o600
        assert status(run_dir)["state"] == "running"
        assert json.loads(rlpipe(run_dir, "--read-only", "status", "--json").stdout)["state"] == "running"
        read_only_pause = rlpipe(run_dir, "--read-only", "pause")
        assert read_only_pause.returncode == 1 and "PERMISSION_DENIED" in read_only_pause.stderr
        assert status(run_dir)["state"] == "running"

        # Health and reflection answer on every service, token or not.
        endpoints = [info["admin"]] + [s["grpc"] for s in info["services"].values()]
        assert len(endpoints) == 5
        for address in endpoints:
            with grpc.insecure_channel(address) as channel:
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING, address
                assert "grpc.health.v1.Health" in ProtoReflectionDescriptorDatabase(channel).get_services(), address
        with grpc.insecure_channel(info["admin"]) as channel:
            assert "rlpipe.v1.Admin" in ProtoReflectionDescriptorDatabase(channel).get_services()

        # Status lists every service, up, with its endpoints.
        live = status(run_dir)
        services = {s["instance"]: s for s in live["services"]}
        assert set(services) == {"trainer", "rollout-0", "reward-0", "reference-0"}
        assert all(s["up"] and s["metrics_url"].startswith("http://") for s in services.values())
        assert (
            live["build_version"] == "0.1.0"
            and live["build_revision"]
            and services["reward-0"]["build_version"] == "0.1.0"
        )
        table = rlpipe(run_dir, "status")
        assert table.returncode == 0 and "rollout-0" in table.stdout and "running" in table.stdout

        # Pause holds the step; resume lets it move again.
        assert rlpipe(run_dir, "pause").returncode == 0
        paused = status(run_dir)
        assert paused["state"] == "paused"
        time.sleep(4)  # a fixed wait, since what it shows is that nothing happens: no step while paused
        assert status(run_dir)["step"] == paused["step"] == max(r.step for r in metric_rows(run_dir) if r.is_step)
        # A trainer that dies while paused comes back paused: the pause lives in the run's bucket, not the process.
        os.kill(info["pids"]["trainer"], signal.SIGKILL)
        wait_for(
            lambda: json.loads((run_dir / "run.json").read_text())["pids"]["trainer"] != info["pids"]["trainer"],
            "the trainer's restart",
            process,
        )
        wait_for(lambda: rlpipe(run_dir, "status", "--json").returncode == 0, "the restarted trainer's admin", process)
        restarted = status(run_dir)
        assert restarted["state"] == "paused" and "still paused after a restart" in restarted["paused_reason"]
        assert {s["instance"]: s for s in restarted["services"]}["trainer"]["restarts"] == 1
        assert rlpipe(run_dir, "resume").returncode == 0
        wait_for(lambda: status(run_dir)["step"] > paused["step"] + 1, "steps after resume", process)

        # A live learning-rate change shows in the next metric rows under the new config version.
        changed = rlpipe(run_dir, "config", "set", "train.learning_rate=3e-5", "--author", "tester")
        assert changed.returncode == 0, changed.stderr
        assert "train.learning_rate" in changed.stdout and "live" in changed.stdout
        wait_for(
            lambda: any(r.get(m.CONFIG_VERSION) == 1 for r in metric_rows(run_dir) if r.is_step),
            "a step under config 1",
            process,
        )
        steps = [r for r in metric_rows(run_dir) if r.is_step]
        assert {r[m.LEARNING_RATE] for r in steps if r[m.CONFIG_VERSION] == 1} == {3e-5}
        assert {r[m.LEARNING_RATE] for r in steps if r[m.CONFIG_VERSION] == 0} == {1e-4}
        # Every service took the new version (their heartbeats report it).
        wait_for(
            lambda: {s["config_version"] for s in status(run_dir)["services"]} == {1},
            "every service on config 1",
            process,
            timeout=30,
        )

        # An invalid value is refused with the field and the reason, and nothing changes.
        bad = rlpipe(run_dir, "config", "set", "train.learning_rate=-1")
        assert bad.returncode == 1 and "train.learning_rate" in bad.stderr and "greater than 0" in bad.stderr
        history = json.loads(rlpipe(run_dir, "config", "history", "--json").stdout)["versions"]
        assert [(v["version"], v["author"]) for v in history] == [(1, "tester")]
        assert status(run_dir)["config_version"] == 1
        assert "learning_rate: 3.0e-05" in rlpipe(run_dir, "config", "show").stdout

        # Checkpoint now, vouch for it, train on, then roll back to it while paused.
        saved = rlpipe(run_dir, "checkpoint")
        assert saved.returncode == 0, saved.stderr
        target = int(saved.stdout.split("checkpoint of step ")[1].split()[0])
        assert rlpipe(run_dir, "mark-stable", str(target)).returncode == 0
        wait_for(lambda: status(run_dir)["last_checkpoint_step"] >= target + 4, "later checkpoints", process)
        assert rlpipe(run_dir, "pause").returncode == 0
        rolled = rlpipe(run_dir, "rollback", "--stable")
        assert rolled.returncode == 0, rolled.stderr
        after = status(run_dir)
        assert after["step"] == target and f"policy version {after['policy_version']}" in rolled.stdout
        version, served = asyncio.run(pull_weights(info["trainer"]))
        assert version == after["policy_version"]
        stored = load_file(str(run_dir / f"step-{target:08d}" / "model.safetensors"))
        for name, tensor in stored.items():
            assert torch.equal(served[name], tensor), name
        listing = {c["step"]: c for c in json.loads(rlpipe(run_dir, "checkpoints", "--json").stdout)["checkpoints"]}
        assert listing[target]["stable"] and not listing[target]["abandoned"]
        assert all(c["abandoned"] for step, c in listing.items() if step > target)
        assert rlpipe(run_dir, "rollback", "99999").returncode == 1  # an unknown step is refused

        # Stop drains and ends the run cleanly.
        assert rlpipe(run_dir, "resume").returncode == 0
        assert rlpipe(run_dir, "stop").returncode == 0
        process.wait(timeout=120)
        assert process.returncode == 0, process.stdout.read()[-3000:]
    lineage = Lineage(run_dir / "lineage.jsonl").records()
    rollback = next(r for r in lineage if isinstance(r, RestartRecord) and r.event == "rollback")
    assert rollback.from_step == target and rollback.abandoned_steps and min(rollback.abandoned_steps) == target + 1
    # Steps after the rollback re-read what the abandoned steps had consumed: still no group twice.
    effective = effective_steps(lineage)
    accounted = [g for r in effective for g, _ in r.groups] + [g for r in effective for g in r.dropped_stale]
    assert len(accounted) == len(set(accounted)) and max(r.step for r in effective) > target
    # What ran is on record: the effective config and build at start and inside each checkpoint.
    assert (run_dir / "effective-config.yaml").read_text().startswith("# config version 0, rlpipe 0.1.0")
    assert json.loads((run_dir / f"step-{target:08d}" / "build.json").read_text())["version"] == "0.1.0"
    assert "learning_rate: 3.0e-05" in (run_dir / f"step-{target:08d}" / "config.yaml").read_text()
    kinds = [event.kind for event in read_events(run_dir / "events.jsonl")]
    assert {"pause", "unpause", "config_change", "rollback", "stop"} <= set(kinds)

    # The stop was recorded as a hold (an orchestrator restarting the trainer gets it back paused);
    # `rlpipe run --resume` continues on purpose, so it clears the hold and trains on from the last save.
    last = max(r.step for r in metric_rows(run_dir) if r.is_step)
    with running_pipeline(config, "--resume") as again:
        # run.json is written anew once every service is ready (the resumed trainer may train on before that).
        wait_for(
            lambda: (
                (run_dir / "run.json").exists() and max(r.step for r in metric_rows(run_dir) if r.is_step) > last + 1
            ),
            "steps after --resume",
            again,
        )
        assert status(run_dir)["state"] == "running"
        assert rlpipe(run_dir, "stop").returncode == 0
        output, _ = again.communicate(timeout=120)
    assert again.returncode == 0, output[-3000:]
    assert "continuing a run that was held" in " ".join(output.split())


def test_a_stalled_pipeline_still_alerts(tiny_model, tmp_path):
    # reward-0 hangs (SIGSTOP): alive to its supervisor, silent to everyone else; no step can complete.
    rules = [
        {
            "name": "no_steps",
            "metric": "reward_mean",
            "condition": "absent",
            "window_s": 8,
            "severity": "critical",
            "actions": ["notify"],
        },
        {
            "name": "role_down",
            "metric": "services_down",
            "condition": "above",
            "threshold": 0,
            "window_steps": 2,
            "severity": "critical",
            "actions": ["notify", "pause"],
        },
    ]
    config, run_dir = start(tiny_model, tmp_path, "stall", alerts={"rules": rules, "cooldown_steps": 0})
    with running_pipeline(config) as process:
        wait_for(
            lambda: (run_dir / "run.json").exists() and sum(r.is_step for r in metric_rows(run_dir)) >= 3,
            "first steps",
            process,
        )
        assert not any(
            e.rule == "role_down" for e in read_events(run_dir / "events.jsonl")
        )  # roles still starting are not down
        hung = json.loads((run_dir / "run.json").read_text())["pids"]["reward-0"]
        os.kill(hung, signal.SIGSTOP)
        try:
            wait_for(lambda: status(run_dir)["state"] == "paused", "the role_down alert's pause", process, timeout=120)
            now = status(run_dir)
            assert {"no_steps", "role_down"} <= {a["rule"] for a in now["alerts"]}
            assert "role_down" in now["paused_reason"]
            assert [s["up"] for s in now["services"] if s["instance"] == "reward-0"] == [False]
        finally:
            os.kill(hung, signal.SIGCONT)
        assert rlpipe(run_dir, "stop").returncode == 0
        process.wait(timeout=120)
        assert process.returncode == 0
    fired = {e.rule for e in read_events(run_dir / "events.jsonl") if e.kind == Event.ALERT}
    assert {"no_steps", "role_down"} <= fired

    # An alert's hold outlives `rlpipe run --resume` (an operator's stop of the held run included): the run comes
    # back held, and the console says by what and how to go on.
    steps = sum(m.PG_LOSS in r for r in metric_rows(run_dir))
    stopped = (run_dir / "run.json").read_text()
    with running_pipeline(config, "--resume") as again:
        ready = lambda: (run_dir / "run.json").exists() and (run_dir / "run.json").read_text() != stopped  # noqa: E731
        wait_for(ready, "the resumed run's services", again)
        held = status(run_dir)
        assert held["state"] == "paused" and "while held: alert role_down" in held["paused_reason"]
        assert rlpipe(run_dir, "stop").returncode == 0
        output, _ = again.communicate(timeout=120)
    assert again.returncode == 0, output[-3000:]
    said = " ".join(output.split())
    assert "still held: stopped: stopped by operator, while held: alert role_down" in said
    assert "An alert set this hold, so --resume keeps it" in said and "continuing a run that was held" not in said
    assert sum(m.PG_LOSS in r for r in metric_rows(run_dir)) == steps  # held throughout: no step


class Receiver(http.server.BaseHTTPRequestHandler):
    posts: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        Receiver.posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_alert_rules_fire_and_act(tiny_model, tmp_path):
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config, run_dir = start(
        tiny_model, tmp_path, "alerts", alerts={"webhook_url": f"http://127.0.0.1:{port}/hook", "cooldown_steps": 0}
    )
    try:
        with running_pipeline(config) as process:
            wait_for(lambda: (run_dir / "run.json").exists() and len(metric_rows(run_dir)) > 4, "first steps", process)
            saved = rlpipe(run_dir, "checkpoint")
            target = int(saved.stdout.split("checkpoint of step ")[1].split()[0])
            assert rlpipe(run_dir, "mark-stable", str(target)).returncode == 0

            # Entropy is ~1 nat here; a floor of 50 makes the rule fire at once, live, and pause the run.
            rule = (
                "[{name: entropy_floor, metric: entropy, condition: below, threshold: 50, window_steps: 2, "
                "severity: critical, actions: [notify, pause]}]"
            )
            assert rlpipe(run_dir, "config", "set", f"alerts.rules={rule}").returncode == 0
            wait_for(lambda: status(run_dir)["state"] == "paused", "the alert's pause", process, timeout=120)
            now = status(run_dir)
            alert = next(a for a in now["alerts"] if a["rule"] == "entropy_floor")
            assert alert["metric"] == "entropy" and alert["threshold"] == 50 and alert["value"] < 50 and alert["window"]
            wait_for(
                lambda: any(p["rule"] == "entropy_floor" for p in Receiver.posts), "the webhook", process, timeout=30
            )
            posted = next(p for p in Receiver.posts if p["rule"] == "entropy_floor")
            assert (
                posted["run_id"] == "alerts" and posted["actions_taken"] == ["notify", "pause"] and posted["value"] < 50
            )
            assert "entropy_floor" in rlpipe(run_dir, "status").stdout

            # The same anomaly with a rollback action returns to the stable checkpoint.
            rule = rule.replace("entropy_floor", "entropy_guard").replace("[notify, pause]", "[rollback]")
            assert rlpipe(run_dir, "config", "set", f"alerts.rules={rule}").returncode == 0
            assert rlpipe(run_dir, "resume").returncode == 0
            wait_for(
                lambda: any(e.kind == Event.ROLLBACK for e in read_events(run_dir / "events.jsonl")),
                "the alert's rollback",
                process,
                timeout=120,
            )
            rolled = next(e for e in read_events(run_dir / "events.jsonl") if e.kind == Event.ROLLBACK)
            assert rolled.step == target and "entropy_guard" in rolled.details["reason"]
            # Still firing after going back: a second rollback to the same step would loop, so it pauses instead.
            wait_for(
                lambda: status(run_dir)["state"] == "paused", "the pause after a repeated firing", process, timeout=120
            )
            events = read_events(run_dir / "events.jsonl")
            assert sum(e.kind == Event.ROLLBACK for e in events) == 1
            assert "fired again after rolling back" in [e for e in events if e.kind == Event.PAUSE][-1].message

            # The stable checkpoint rots: an operator's rollback to it is refused with the reason and changes
            # nothing; an alert's rollback, which nobody awaits, holds the run instead.
            (run_dir / f"step-{target:08d}" / "model.safetensors").write_bytes(b"bitrot")
            before = status(run_dir)
            refused = rlpipe(run_dir, "rollback", "--stable")
            assert refused.returncode == 1 and "cannot be loaded" in " ".join(refused.stderr.split()), refused.stderr
            assert status(run_dir)["policy_version"] == before["policy_version"]
            rule = rule.replace("entropy_guard", "entropy_rot")
            assert rlpipe(run_dir, "config", "set", f"alerts.rules={rule}").returncode == 0
            assert rlpipe(run_dir, "resume").returncode == 0
            wait_for(
                lambda: "entropy_rot" in status(run_dir)["paused_reason"],
                "the pause after a failed rollback",
                process,
                timeout=120,
            )
            reason = status(run_dir)["paused_reason"]
            assert "rollback failed" in reason and f"checkpoint of step {target} cannot be loaded" in reason, reason

            # And with a stop action the run ends.
            rule = rule.replace("entropy_rot", "entropy_stop").replace("[rollback]", "[notify, stop]")
            assert rlpipe(run_dir, "config", "set", f"alerts.rules={rule}").returncode == 0
            assert rlpipe(run_dir, "resume").returncode == 0
            process.wait(timeout=180)
            assert process.returncode == 0
        fired = {row.alert for row in metric_rows(run_dir)}
        assert {"entropy_floor", "entropy_guard", "entropy_stop"} <= fired
        assert any(p["rule"] == "entropy_stop" and p["actions_taken"] == ["notify", "stop"] for p in Receiver.posts)
    finally:
        server.shutdown()
