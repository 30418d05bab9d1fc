"""`rlpipe verify`, `rlpipe run --smoke`, `rlpipe alerts test`, `rlpipe checkpoints verify` and `rlpipe samples`,
as an operator runs them: real processes, a real webhook receiver, moto_server S3, the embedded deployment."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from services.common.config import load_config
from services.common.model.modeling import load_model
from services.common.observe import metrics as m
from services.common.transport.storage import open_store
from services.trainer.checkpointing.lineage import Lineage, StepRecord
from services.trainer.checkpointing.state import Checkpoint, TrainerState, detached_copy, rng_state
from services.trainer.checkpointing.store import CheckpointStore
from tests.support.paths import ROOT
from tests.support.runs import config_file, metric_rows, running_pipeline, wait_for
from tests.support.servers import free_port

pytestmark = pytest.mark.integration


def rlpipe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


class Webhook:
    """A local HTTP receiver that records the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    receiver = Webhook()
    yield receiver
    receiver.close()


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- alerts test ---------------------------------------------------------------------------------


def test_alerts_test_fires_every_rule_through_log_events_metrics_prometheus_and_a_real_webhook(
    tmp_path, tiny_model, webhook
):
    config = config_file(tmp_path, tiny_model, alerts={"webhook_url": webhook.url})
    rules = [rule.name for rule in load_config(config).alerts.rules]
    done = rlpipe("alerts", "test", "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(body["rule"] for body in webhook.received) == sorted(rules)
    assert all("drill" in body["message"] and body["actions_taken"] == ["notify"] for body in webhook.received)
    run_dir = tmp_path / "runs" / "test"
    assert sorted(e["rule"] for e in jsonl(run_dir / "events.jsonl") if e["kind"] == "alert") == sorted(rules)
    assert sorted(row.alert for row in metric_rows(run_dir) if row.alert) == sorted(rules)
    logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert sorted(line["rule"] for line in logged if line["event"] == "alert") == sorted(rules)
    assert f"{len(rules)} rlpipe_alerts_fired_total at http://" in done.stdout


def test_alerts_test_fails_naming_the_webhook_when_it_is_unreachable(tmp_path, tiny_model):
    unreachable = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there
    config = config_file(tmp_path, tiny_model, alerts={"webhook_url": unreachable})
    done = rlpipe("alerts", "test", "kl_too_high", "--config", str(config))
    assert done.returncode == 1
    failures = [line for line in done.stderr.splitlines() if line.startswith("rlpipe alerts test:")]
    assert len(failures) == 1 and failures[0].startswith("rlpipe alerts test: sink webhook failed: 1 of 1 POSTs to")
    assert "Connection refused" in failures[0]
    events = jsonl(tmp_path / "runs" / "test" / "events.jsonl")
    assert [e["rule"] for e in events if e["kind"] == "alert"] == ["kl_too_high"]  # the other sinks still got it


def test_alerts_test_refuses_an_unknown_rule_naming_the_configured_ones(tmp_path, tiny_model):
    config = config_file(tmp_path, tiny_model)
    done = rlpipe("alerts", "test", "no_such_rule", "--config", str(config))
    assert done.returncode == 2
    assert "no alert rule 'no_such_rule' in this config (rules: entropy_collapse, kl_too_high," in done.stderr
    assert not (tmp_path / "runs" / "test" / "events.jsonl").exists()


# -- checkpoints verify ------------------------------------------------------------------------------


def save_steps(cfg, steps: list[int], model_dir: Path, state_of=lambda model: detached_copy(model)) -> None:
    """Checkpoints of ``steps`` with the tiny model's weights, through the trainer's own store (with its mirror)."""
    model = load_model(cfg.model.path)
    mirror = open_store(cfg.checkpoint.mirror_url, cfg.checkpoint)
    store = CheckpointStore(open_store(cfg.checkpoint_url, cfg.checkpoint), cfg.run_id, 5, mirror=mirror)
    store.start_fresh()
    for step in steps:
        state = TrainerState(step=step, policy_version=step, last_experience_seq=step, incarnation=store.incarnation)
        store.save(Checkpoint(step, state_of(model), {}, {}, rng_state(), state), model_dir)


def flip_bytes(endpoint: str, key: str) -> None:
    from minio import Minio

    client = Minio(endpoint, access_key="testing", secret_key="testing", secure=False)
    data = bytearray(client.get_object("ckpt", key).read())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data, past the safetensors header
    client.put_object("ckpt", key, io.BytesIO(bytes(data)), len(data))


def findings(done: subprocess.CompletedProcess) -> list[str]:
    """What the command said was wrong (stderr also carries the model loader's progress bar)."""
    return [line for line in done.stderr.splitlines() if line.startswith("rlpipe checkpoints verify: ")]


def test_checkpoints_verify_names_the_step_and_file_of_a_corrupted_tensor_in_s3(tmp_path, tiny_model, s3):
    model_dir, _ = tiny_model
    checkpoint = s3.checkpoint(mirror_url=(tmp_path / "mirror").as_uri())
    config = config_file(tmp_path, tiny_model, checkpoint=checkpoint)
    save_steps(load_config(config), [1, 2], model_dir)
    flip_bytes(f"127.0.0.1:{s3.port}", "prefix/test/step-00000002/model.safetensors")

    done = rlpipe("checkpoints", "verify", "--all", "--json", "--config", str(config))
    assert done.returncode == 1
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["store"], r["step"], r["ok"]) for r in rows] == [
        ("s3://ckpt/prefix", 1, True),
        ("s3://ckpt/prefix", 2, False),
        ((tmp_path / "mirror").as_uri(), 1, True),
        ((tmp_path / "mirror").as_uri(), 2, True),  # the mirror's copy is whole
    ]
    assert findings(done) == [
        "rlpipe checkpoints verify: s3://ckpt/prefix: step 2: model.safetensors does not match its manifest hash"
    ]
    assert "tensors loaded into" in rows[0]["detail"]

    newest = rlpipe("checkpoints", "verify", "--json", "--config", str(config))  # no STEP: the newest, step 2
    assert newest.returncode == 1 and [json.loads(line)["step"] for line in newest.stdout.splitlines()] == [2, 2]
    older = rlpipe("checkpoints", "verify", "1", "--config", str(config))
    assert older.returncode == 0, older.stdout + older.stderr


def test_checkpoints_verify_fails_a_whole_checkpoint_whose_weights_do_not_fit_the_model(tmp_path, tiny_model):
    model_dir, _ = tiny_model
    checkpoint = {"store_url": (tmp_path / "store").as_uri(), "mirror_url": (tmp_path / "mirror").as_uri()}
    config = config_file(tmp_path, tiny_model, checkpoint=checkpoint)

    def renamed(model) -> dict:
        return {f"renamed.{name}": tensor for name, tensor in detached_copy(model).items()}

    save_steps(load_config(config), [3], model_dir, state_of=renamed)
    done = rlpipe("checkpoints", "verify", "--config", str(config))
    assert done.returncode == 1
    failures = findings(done)
    assert len(failures) == 2  # the store and the mirror
    assert all("step 3: weights do not load: checkpoint does not fit the model: missing" in f for f in failures)


# -- the whole checklist ---------------------------------------------------------------------------


def verify_config(tmp_path: Path, tiny_model, **sections) -> Path:
    return config_file(tmp_path, tiny_model, "deploy.yaml", run_id="deploy", **sections)


VERIFY_LEARNING_RATE = 3e-4


@pytest.fixture(scope="module")
def verified(tmp_path_factory, tiny_model) -> Iterator[tuple[subprocess.CompletedProcess, Path, Webhook]]:
    """One `rlpipe verify` of the embedded deployment with the tiny model, shared by the tests that read it."""
    tmp_path = tmp_path_factory.mktemp("verify")
    receiver = Webhook()
    config = verify_config(tmp_path, tiny_model, alerts={"webhook_url": receiver.url})
    # With a command-line override, as `rlpipe run` takes them: the smoke run must train with it.
    done = rlpipe("verify", "--config", str(config), f"train.learning_rate={VERIFY_LEARNING_RATE}", timeout=900)
    yield done, tmp_path / "runs" / "deploy-smoke", receiver
    receiver.close()


@pytest.mark.e2e
def test_verify_passes_on_the_embedded_deployment_and_writes_its_record(verified):
    done, run_dir, receiver = verified
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((run_dir / "verify.json").read_text())
    assert record["passed"] is True and record["failed"] == [] and record["run_id"] == "deploy-smoke"
    assert record["overrides"] == {"train.learning_rate": VERIFY_LEARNING_RATE}
    names = ["roles", "weight-sync", "smoke-run", "checkpoint", "alert-drill", "metrics"]
    names += ["first-step", "ranges", "jumps", "resources"]  # how the smoke run's steps went
    assert [(c["name"], c["status"]) for c in record["checks"]] == [(name, "pass") for name in names] + [
        ("remote-services", "skip"),  # the config names no remote reward or environment service
        ("tuning", "pass"),
    ]
    # Every role's processes were judged, not the trainer's rows alone.
    resources = next(c["detail"] for c in record["checks"] if c["name"] == "resources")
    assert [f"{role} host RSS" in resources for role in ("reference", "reward", "rollout", "trainer")] == [True] * 4
    concluded = (
        f"passed all {len(names) + 1} checks that ran; skipped: remote-services; keep this record as the baseline"
    )
    assert record["conclusion"] == concluded
    assert record["libraries"]["torch"] == importlib.metadata.version("torch")
    assert record["config"]["run_id"] == "deploy-smoke"
    assert f"record: {run_dir / 'verify.json'} {run_dir / 'verify.md'}" in done.stderr
    assert (run_dir / "verify.md").read_text().startswith("# Verification of ")
    rows = metric_rows(run_dir)
    assert [r.step for r in rows if r.is_step] == [1, 2, 3]  # the smoke run: 3 steps at batch 2
    assert {r[m.LEARNING_RATE] for r in rows if r.is_step} == {VERIFY_LEARNING_RATE}
    rules = sorted(rule.name for rule in load_config(run_dir.parent.parent / "deploy.yaml").alerts.rules)
    events = jsonl(run_dir / "events.jsonl")
    assert sorted(e["rule"] for e in events if e["kind"] == "alert" and "drill" in e["message"]) == rules
    # The trainer posts its heartbeats to the same receiver; the drill's firings say they are one.
    assert sorted(body["rule"] for body in receiver.received if "drill" in body.get("message", "")) == rules


@pytest.mark.e2e
def test_verify_runs_one_tuning_trial_of_the_smoke_config_and_leaves_nothing_beside_the_deployment(verified):
    _, run_dir, _ = verified
    [tuning] = [c for c in json.loads((run_dir / "verify.json").read_text())["checks"] if c["name"] == "tuning"]
    evidence = tuning["detail"]
    assert evidence.startswith("trial deploy-smoke-tune-t0 (train.learning_rate ") and "after 3 steps" in evidence
    # Sampled within a factor of two of the configured rate, as the study's one parameter.
    rate = float(evidence.removeprefix("trial deploy-smoke-tune-t0 (train.learning_rate ").partition(")")[0])
    assert VERIFY_LEARNING_RATE / 2 <= rate <= VERIFY_LEARNING_RATE * 2
    # Its run and checkpoints were the check's own, in the verification's temporary folder.
    assert sorted(path.name for path in run_dir.parent.iterdir()) == ["deploy-smoke"]


@pytest.mark.e2e
def test_samples_show_exactly_the_groups_and_rewards_the_trainer_applied(verified):
    done, run_dir, _ = verified
    assert done.returncode == 0, done.stderr[-3000:]
    applied = {r.step: r for r in Lineage(run_dir / "lineage.jsonl").records() if isinstance(r, StepRecord)}
    rows = {r.step: r for r in metric_rows(run_dir) if r.is_step}
    for step in (1, 2, 3):
        shown = rlpipe("--run-dir", str(run_dir), "samples", "--step", str(step), "--n", "100", "--json")
        assert shown.returncode == 0, shown.stderr
        groups = [json.loads(line) for line in shown.stdout.splitlines()]
        assert sorted(g["group_id"] for g in groups) == sorted(group_id for group_id, _ in applied[step].groups)
        rewards = [c["reward"] for g in groups for c in g["completions"]]
        assert sum(rewards) / len(rewards) == pytest.approx(rows[step][m.REWARD_MEAN], abs=1e-6)
    table = rlpipe("samples", "--run", str(run_dir), "--n", "1")  # the newest step, as a table
    assert table.returncode == 0 and "step 3  group " in table.stdout and "KL mean" in table.stdout


@pytest.mark.e2e
def test_verify_fails_naming_the_roles_check_when_the_reward_service_is_killed(tmp_path, tiny_model):
    config = verify_config(tmp_path, tiny_model, supervision={"max_restarts": 0})
    run_dir = tmp_path / "runs" / "deploy-smoke"
    verify = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "verify", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "run.json").is_file():  # written once every service is ready
            assert verify.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        reward_pid = json.loads((run_dir / "run.json").read_text())["pids"]["reward-0"]
        subprocess.run(["kill", f"-{signal.SIGKILL.value}", str(reward_pid)], check=True)
        _, err = verify.communicate(timeout=600)
    finally:
        if verify.poll() is None:
            verify.kill()
            verify.communicate()
    assert verify.returncode == 1
    failed = [line for line in err.splitlines() if line.startswith("rlpipe verify: ")]
    assert failed[0].startswith("rlpipe verify: roles failed: ") and "reward-0" in failed[0]
    record = json.loads((run_dir / "verify.json").read_text())
    assert record["failed"][0] == "roles"
    assert "**failed**: roles" in (run_dir / "verify.md").read_text()


def test_smoke_run_refuses_an_environment_that_would_override_its_run_id(tmp_path, tiny_model):
    config = verify_config(tmp_path, tiny_model)
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", "--smoke", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RLPIPE_RUN_ID": "deploy"},
    )
    assert done.returncode == 2
    assert "run_id: set by RLPIPE_* environment variables, which win over the smoke run's values" in done.stderr
    assert not (tmp_path / "runs").exists()  # nothing started, the deployment's run untouched


@pytest.mark.e2e
def test_run_smoke_logs_a_batch_from_every_stage_under_its_own_run_id(tmp_path, tiny_model):
    config = verify_config(tmp_path, tiny_model)
    deployment = tmp_path / "runs" / "deploy"
    deployment.mkdir(parents=True)
    (deployment / "metrics.jsonl").write_text('{"step": 7, "reward_mean": 0.5}\n')
    done = rlpipe("run", "--smoke", str(config), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    smoke_rows = [row for row in metric_rows(tmp_path / "runs" / "deploy-smoke") if row.is_step]
    assert [row.step for row in smoke_rows] == [1, 2, 3]
    assert (deployment / "metrics.jsonl").read_text() == '{"step": 7, "reward_mean": 0.5}\n'  # untouched
    smoke = next(line for line in done.stdout.splitlines() if "smoke-run" in line)
    assert "pass" in smoke and all(stage in smoke for stage in ("sampling", "reward", "reference", "update 3 steps"))


@pytest.mark.e2e
def test_verify_checks_a_live_deployment_through_its_admin_address_without_a_smoke_run(tmp_path, tiny_model):
    config = verify_config(tmp_path, tiny_model, train={"total_steps": 200}, checkpoint={"save_every_steps": 2})
    run_dir = tmp_path / "runs" / "deploy"
    with running_pipeline(config) as pipeline:
        wait_for(lambda: (run_dir / "step-00000002" / "manifest.json").is_file(), "a checkpoint", pipeline, 600)
        wait_for(lambda: (run_dir / "run.json").is_file(), "run.json", pipeline)
        admin = json.loads((run_dir / "run.json").read_text())["admin"]
        # Held between steps, as an operator may hold it to check it: its 200 steps would only compete for the
        # cores with the checks (verify of a deployment that trains on is the smoke run's own test above).
        held = rlpipe("--address", admin, "--run-dir", str(run_dir), "pause", "--reason", "verify")
        assert held.returncode == 0, held.stderr
        done = rlpipe("--address", admin, "--run-dir", str(run_dir), "verify", "--config", str(config), timeout=600)
        assert pipeline.poll() is None  # checked, not stopped
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((run_dir / "verify.json").read_text())
    statuses = [(c["name"], c["status"]) for c in record["checks"]]
    assert statuses == [
        ("roles", "pass"),
        ("weight-sync", "pass"),
        ("smoke-run", "skip"),
        ("checkpoint", "pass"),
        ("alert-drill", "pass"),
        ("metrics", "pass"),
        ("ranges", "pass"),
        ("jumps", "pass"),
        ("resources", "pass"),
        ("remote-services", "skip"),
        ("tuning", "skip"),
    ]
    assert not (tmp_path / "runs" / "deploy-smoke").exists()


@pytest.mark.unit
def test_a_live_deployments_roles_pass_with_replicas_scaled_in_and_fail_on_one_down_or_a_role_left_without_any():
    """A replica stopped in order (a KEDA scale-in) is neither a problem nor probed; one down is; and a stage
    role whose replicas all stopped has none to do its work."""
    from services.cli.verify.checklist import live_roles_check
    from services.common.pb import admin_pb2

    def service(instance: str, role: str, **state) -> admin_pb2.ServiceStatus:
        return admin_pb2.ServiceStatus(instance=instance, role=role, grpc_address=f"{instance}:1", **state)

    probed = []

    def probe(address: str) -> None:
        probed.append(address)

    running = [service(f"{r}-0", r, up=True) for r in ("trainer", "rollout", "reward", "reference")]
    scaled_in = [*running, service("rollout-1", "rollout", stopped=True)]
    check = live_roles_check(scaled_in, probe)
    assert check.status == "pass" and "rollout-1" not in check.detail and "rollout-1:1" not in probed

    down = live_roles_check([*running, service("rollout-2", "rollout")], probe)
    assert down.status == "fail" and down.detail == "rollout-2: down in the trainer's status"

    gone = [s for s in running if s.role != "reward"] + [service("reward-0", "reward", stopped=True)]
    left = live_roles_check(gone, probe)
    assert left.status == "fail" and left.detail == "reward: no replica up in the trainer's status"
