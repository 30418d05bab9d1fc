"""The S3 endpoint goes away mid-run: saves fail and are retried, training goes on, and saves succeed again;
claim-checked groups wait for the store instead of being dead-lettered.

Most runs here generate with transformers (``rollout.backend: hf``): the store is under test, not the engine
(docs/testing.md gives what each saved; the unsaved-end run stays on vLLM, as hf saved it nothing).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time

import pytest

from services.common.config import CheckpointConfig
from services.common.observe import metrics as m
from services.common.observe.records import read_metrics
from services.common.transport.storage import open_store
from services.trainer.checkpointing.lineage import Lineage, effective_steps
from services.trainer.checkpointing.store import CheckpointStore
from tests.support.paths import BIN, ROOT
from tests.support.runs import RLPIPE_RUN, config_file, rlpipe, run_pipeline, running_pipeline, wait_for
from tests.support.servers import StoppableS3, free_port, wait_for_port

# Whole pipelines, minutes each: the slow tier (make test runs it after the rest).
pytestmark = pytest.mark.e2e


class UnreachableS3(StoppableS3):
    """A moto_server behind a TCP relay: stop() refuses and cuts every connection, but the objects survive.

    An outage that loses the store's content would lose the bodies of claim-checked groups already in
    flight (rightly dead-lettered as missing); this one is a store that is only unreachable for a while.
    """

    def __init__(self):
        self.listener: socket.socket | None = None
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        self.backend = free_port()
        self.moto = subprocess.Popen(
            [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.backend)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.backend, self.moto, "moto_server")
        super().__init__()

    def start(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def stop(self) -> None:
        with self.lock:
            sockets, self.open = self.open, []
            if self.listener is not None:
                sockets.append(self.listener)
                self.listener = None
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.stop()
        self.moto.kill()
        self.moto.wait()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # stopped
                return
            upstream = socket.create_connection(("127.0.0.1", self.backend))
            with self.lock:
                if self.listener is not listener:  # stopped meanwhile
                    client.close()
                    upstream.close()
                    return
                self.open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def test_checkpoints_survive_an_object_store_outage(tiny_model, tmp_path, s3):
    checkpoint = s3.checkpoint(save_every_steps=2, keep_last=20)
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="outage",
        # Ended by `rlpipe stop` once a save meets the store again, not at a step count: a count long enough to
        # outlast the outage (a failed save retries for ~7 s) trained on for minutes after it.
        train={"total_steps": 100_000, "batch_size": 8, "learning_rate": 1e-5},
        checkpoint=checkpoint,
        rollout={"backend": "hf"},
    )
    run_dir = tmp_path / "runs" / "outage"
    metrics = run_dir / "metrics.jsonl"
    with running_pipeline(config) as run:
        deadline = time.monotonic() + 300
        while not any(m.CHECKPOINT_SAVED in r for r in read_metrics(metrics)):
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        s3.stop()
        # An operator can still ask how the run is: status answers and says the store is unreadable.
        during = rlpipe(run_dir, "status", "--json")
        assert during.returncode == 0, during.stderr
        assert json.loads(during.stdout)["checkpoint_store_error"]
        assert "unreadable" in rlpipe(run_dir, "status").stdout
        while not any(r.get(m.CHECKPOINT_FAILED) for r in read_metrics(metrics)):
            assert run.poll() is None and time.monotonic() < deadline, "no failed save while the store was down"
            time.sleep(0.2)
        failed_at = max(r.step for r in read_metrics(metrics) if r.get(m.CHECKPOINT_FAILED))
        # Training goes on with the store still down: steps after the failed save are applied before it is back.
        wait_for(
            lambda: [r for r in read_metrics(metrics) if r.is_step and r.step >= failed_at + 3],
            "steps applied while the store is down",
            run,
            timeout=240,
        )
        assert not any(r.get(m.CHECKPOINT_SAVED) and r.step > failed_at for r in read_metrics(metrics))
        s3.start()
        # A periodic save succeeds on the store that came back; then the stop saves the run's last step.
        wait_for(
            lambda: any(r.get(m.CHECKPOINT_SAVED) and r.step > failed_at for r in read_metrics(metrics)),
            "a save after the store came back",
            run,
            timeout=240,
        )
        assert rlpipe(run_dir, "stop").returncode == 0
        output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output[-4000:]
    all_rows = read_metrics(metrics)
    steps = [r.step for r in all_rows if r.is_step]
    assert steps == list(range(1, steps[-1] + 1))  # training never stopped
    last = steps[-1]
    saved_after = [r.step for r in all_rows if m.CHECKPOINT_SAVED in r and r.step > failed_at]
    assert saved_after and saved_after[-1] == last
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert '"store_retry"' in log and '"checkpoint_failed"' in log and '"alert": true' in log
    # Only complete steps exist for loaders, and each loads with matching hashes.
    cfg = CheckpointConfig(**{k: v for k, v in checkpoint.items() if k.startswith("s3_")})
    store = CheckpointStore(open_store(checkpoint["store_url"], cfg), "outage", keep_last=20)
    assert store.steps() and store.steps()[-1] == last
    for step in store.steps():
        assert store.load(step).step == step


def test_a_run_that_ends_with_its_last_steps_unsaved_does_not_exit_clean(tiny_model, tmp_path, s3):
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="unsaved",
        train={"total_steps": 8, "batch_size": 8, "learning_rate": 1e-5},
        checkpoint=s3.checkpoint(save_every_steps=1000),
    )
    run_dir = tmp_path / "runs" / "unsaved"
    # Held until the store is down: eight steps could otherwise be done and saved before it goes.
    with running_pipeline(config, "--paused") as run:
        wait_for(
            lambda: (run_dir / "run.json").exists(), "every service ready", run
        )  # the start-up checks wrote to the store
        s3.stop()
        assert rlpipe(run_dir, "resume").returncode == 0
        output, _ = run.communicate(timeout=600)
    # The final save failed: the trainer says so and exits 1, and so does `rlpipe run`.
    assert run.returncode == 1, output[-3000:]
    assert "services failed" in output and "trainer" in output.split("services failed")[-1]
    assert '"ended_unsaved"' in (run_dir / "logs" / "trainer.log").read_text()


@pytest.fixture
def unreachable_s3(monkeypatch):
    monkeypatch.setenv("RLPIPE_S3_ACCESS_KEY", "testing")
    monkeypatch.setenv("RLPIPE_S3_SECRET_KEY", "testing")
    endpoint = UnreachableS3()
    yield endpoint
    endpoint.close()


CLAIM_STEPS = 12
CLAIM_OUTAGE_S = 25.0


def test_claim_checked_groups_cross_an_object_store_outage_without_dead_letters(tiny_model, tmp_path, unreachable_s3):
    nats = {"ack_wait_s": 3, "heartbeat_s": 1, "max_deliver": 2, "duplicate_window_s": 600, "claim_check_bytes": 512}
    # The outage outlasts every delivery a message has (ack_wait_s * max_deliver = 6 s) several times over.
    assert 3 * nats["ack_wait_s"] * nats["max_deliver"] < CLAIM_OUTAGE_S
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="claims",
        train={"total_steps": CLAIM_STEPS, "batch_size": 8, "learning_rate": 1e-5},
        checkpoint=unreachable_s3.checkpoint(save_every_steps=4, keep_last=20),
        nats=nats,
        rollout={"backend": "hf", "prompts_per_batch": 4},
    )
    run_dir = tmp_path / "runs" / "claims"
    steps = lambda: [r for r in read_metrics(run_dir / "metrics.jsonl") if r.is_step]  # noqa: E731
    with running_pipeline(config) as run:
        wait_for(lambda: len(steps()) >= 2, "step 2", run)
        unreachable_s3.stop()
        time.sleep(CLAIM_OUTAGE_S)  # the outage's length is what the run must survive, so the wait is fixed
        assert run.poll() is None, "the run died during the store outage"
        stopped_at = len(steps())
        unreachable_s3.start()
        output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output[-4000:]
    assert stopped_at < CLAIM_STEPS, "the outage came too late to meet claim-checked traffic"
    restarts = json.loads((run_dir / "run.json").read_text())["restarts"]
    assert restarts == {}, f"a service crashed over the outage: {restarts}"  # held, not crashed and restarted
    assert [r.step for r in steps()] == list(range(1, CLAIM_STEPS + 1))
    logs = {path.stem: path.read_text() for path in (run_dir / "logs").glob("*.log")}
    # Every group was claim-checked, so the stages met the outage while storing or reading bodies ...
    held = [name for name, text in logs.items() if '"dependency_unavailable"' in text]
    assert held, "no stage met the outage"
    # ... and not one group was dead-lettered or written off for it.
    for name, text in logs.items():
        assert '"dead_letter"' not in text and '"group_lost_to_dead_letters"' not in text, name
    final = effective_steps(Lineage(run_dir / "lineage.jsonl").records())
    assert [r.step for r in final] == list(range(1, CLAIM_STEPS + 1))
    applied = [group for r in final for group, _ in r.groups]
    assert len(applied) == CLAIM_STEPS * 8 and len(set(applied)) == len(applied)


def test_a_run_resumed_over_a_store_that_came_back_empty_is_refused_naming_its_step(tiny_model, tmp_path, s3):
    """The endpoint answers again, but without the run's checkpoints (a bucket re-created, a volume not mounted):
    the startup storage probe passes, and the listing is empty. Before, the trainer took that for a run without
    checkpoints and started again from base weights, writing a restart into the lineage that abandoned every step.
    Its own record says it saved step 4: it waits checkpoint.resume_wait_s, then refuses (exit 2), writing nothing."""
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="emptied",
        train={"total_steps": 4},
        checkpoint=s3.checkpoint(save_every_steps=2, keep_last=5, resume_wait_s=3),
        rollout={"backend": "hf"},
    )
    first, _ = run_pipeline(config)
    assert first.returncode == 0, first.stdout[-3000:]
    run_dir = runs / "emptied"
    lineage_before = (run_dir / "lineage.jsonl").read_text()
    s3.stop()
    s3.start()  # moto comes back empty

    resume = [*RLPIPE_RUN, str(config), "--resume"]
    again = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=600)
    # The trainer refused (exit 2): not restarted, and the run ends with its reason.
    assert again.returncode == 2, again.stdout[-3000:]
    assert "rlpipe run: trainer refused to run: " in again.stderr and "but step 4" in again.stderr
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.count('"start_refused"') == 1 and '"resume_waiting"' in trainer_log
    assert "holds no checkpoint of this run, but step 4" in trainer_log
    assert "s3://ckpt/prefix/emptied/step-00000004/" in trainer_log
    assert (run_dir / "lineage.jsonl").read_text() == lineage_before
    store = CheckpointStore(open_store("s3://ckpt/prefix", CheckpointConfig(**s3.checkpoint())), "emptied", keep_last=5)
    assert store.store.list("emptied/") == []  # and nothing was written to the store: no step, not even a fence
