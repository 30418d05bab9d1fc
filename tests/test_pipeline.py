"""The whole pipeline as a user runs it: `rlpipe run` with real NATS, vLLM, gRPC and one process per service.

Started held (`--paused`), it takes garbage and wrong-schema messages into every stage's input; they must land
in DEAD with reasons (the trainer's once it is resumed) while training goes on to the end.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import msgpack
import nats
import pytest

from services.cli.dead_letters import operator_options
from services.cli.runs import read_run
from services.cli.verify.smoke import trainer_status
from services.common.config import CheckpointConfig
from services.common.model.datasets import load_jsonl
from services.common.model.evaluation import greedy_accuracy
from services.common.model.modeling import load_model, load_tokenizer
from services.common.observe import metrics as m
from services.common.transport.storage import open_store
from services.common.transport.streams import (
    DEAD,
    EXPERIENCE,
    H_REASON,
    H_SEQ,
    H_SERVICE,
    H_STREAM,
    stream_name,
    subject,
)
from services.trainer.checkpointing.store import CheckpointStore
from tests.support.paths import ROOT
from tests.support.runs import RLPIPE_RUN, config_file, metric_rows, rlpipe, run_info, running_pipeline

pytestmark = pytest.mark.e2e

STEP_METRICS = (
    m.REWARD_MEAN,
    m.REWARD_STD,
    m.ENTROPY,
    m.KL_REF,
    m.RESPONSE_LENGTH_MEAN,
    m.TERMINATION_RATE,
    m.TRUNCATION_RATE,
    m.CLIPFRAC,
    m.APPROX_KL,
    m.GRAD_NORM,
    m.STEP_TIME_S,
    m.POLICY_VERSION,
    m.LEARNING_RATE,
)
TOTAL_STEPS = 10
STAGE_INPUTS = ("prompts", "rollouts", "scored", EXPERIENCE)


def bad_messages() -> list[bytes]:
    """Garbage and a wrong-schema message, for each stage's input."""
    return [b"\x00\xffnot-msgpack", msgpack.packb({"v": 1, "kind": "nonsense", "group_id": "x"})]


async def next_letters(sub, count: int, timeout: float) -> list[dict]:
    letters = []
    for _ in range(count):
        msg = await sub.next_msg(timeout=timeout)
        letters.append(dict(msg.headers or {}))
    return letters


async def dead_letters_around_a_resume(nats_url: str, run_dir: Path, options: dict) -> tuple[list[dict], list[dict]]:
    """Inject bad messages into every stage's input while the run is held; (DEAD's letters before the resume, after).

    Held, the trainer reads nothing and only the first prompts are out, so every stage must read past its bad
    messages to finish the run: none can end before its letters are in DEAD.
    """
    nc = await nats.connect(nats_url, **options)
    try:
        js = nc.jetstream()
        sub = await js.subscribe(f"{subject('pipe', DEAD)}.>", ordered_consumer=True)  # every role's letters
        for edge in STAGE_INPUTS:
            for payload in bad_messages():
                await js.publish(subject("pipe", edge), payload)
        # The three stages before the trainer dead-letter theirs while it is held.
        held = await next_letters(sub, 2 * (len(STAGE_INPUTS) - 1), timeout=120)
        resumed = await asyncio.to_thread(rlpipe, run_dir, "resume")
        assert resumed.returncode == 0, resumed.stderr
        return held, await next_letters(sub, 2, timeout=120)
    finally:
        await nc.close()


@pytest.mark.timeout(900)
def test_rlpipe_run_end_to_end(tiny_model, tmp_path):
    _, data_dir = tiny_model
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        "pipeline.yaml",
        run_id="pipe",
        train={"total_steps": TOTAL_STEPS, "batch_size": 8, "learning_rate": 2e-5, "max_inflight_batches": 2},
        data={"eval_every_steps": 5, "eval_size": 200},
        checkpoint={"save_every_steps": 5, "keep_last": 3},
        rollout={"replicas": 2, "prompts_per_batch": 4},
        cost={"per_device_hour": {"cpu-core": 0.05}},
        # A warm starter of the run's own, as `rlpipe run` starts by default (not the test worker's pool): the
        # imports it spent for every role are its own line in the run's device-hours.
        service={"warm_start_pool": None},
    )
    run_dir = runs / "pipe"
    with running_pipeline(config, "--paused") as process:
        info = run_info(run_dir, process, timeout=600)
        status = trainer_status(info["admin"], (run_dir / "admin.token").read_text().strip())
        assert (status.state, status.step) == ("paused", 0), status
        operator = operator_options(run_dir)  # the run's broker admits only its roles' keys
        held, resumed = asyncio.run(dead_letters_around_a_resume(info["nats_url"], run_dir, operator))
        output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    # `rlpipe runs` reads how it ended from the files it left (its exit record, metrics and usage).
    listed = read_run(run_dir)
    assert (listed.state, listed.exit_code, listed.step) == ("finished", 0, TOTAL_STEPS)
    assert listed.resources is not None and listed.resources.cost is not None

    # Both bad messages of every stage input are in DEAD, with the reason, origin and service; the trainer's own
    # only once it was resumed.
    assert "held (started with --paused)" in output
    by_stream: dict[str, list[str]] = {}
    for letter in held + resumed:
        by_stream.setdefault(letter[H_STREAM], []).append(letter[H_REASON])
    assert {letter[H_STREAM] for letter in resumed} == {stream_name("pipe", EXPERIENCE)}
    for edge in STAGE_INPUTS:
        reasons = by_stream[stream_name("pipe", edge)]
        # Two rollout replicas read PROMPTS: either may dead-letter its bad message first.
        garbage, wrong_schema = sorted(reasons, key=lambda reason: "not msgpack" not in reason)
        assert len(reasons) == 2 and "not msgpack" in garbage and "kind" in wrong_schema, (edge, reasons)
    assert all(int(letter[H_SEQ]) > 0 and letter[H_SERVICE] for letter in held + resumed)

    # The trainer applied every step, and each logged metric is present and finite; every key of every row (step,
    # eval, checkpoint rows) is declared in the metrics contract (metric_rows checks each).
    rows = metric_rows(run_dir)
    steps = [r for r in rows if r.is_step]
    assert [r.step for r in steps] == list(range(1, TOTAL_STEPS + 1))
    for row in steps:
        for metric in STEP_METRICS:
            assert row.finite(metric) is not None, (row.step, metric.key)
    # Completions generated after a weight sync carry the new policy version.
    assert steps[-1][m.GENERATED_BY_VERSION_MAX] >= 1
    assert [r[m.POLICY_VERSION] for r in steps] == list(range(1, TOTAL_STEPS + 1))
    # Each row splits the wall time since the previous one by phase; the learner's own step is inside compute.
    split = [m.TIME_SPLIT.of(phase) for phase in ("wait", "compute", "publish", "eval", "bookkeeping")]
    assert all((value := row.finite(phase)) is not None and value >= 0 for row in steps for phase in split)
    assert all(row[m.TIME_SPLIT.of("compute")] >= row[m.STEP_TIME_S] for row in steps)
    assert steps[0][m.TIME_SPLIT.of("eval")] > 0  # the step-0 evaluation comes before the first step
    assert "wall s per step" in output and "Where the time goes" in (run_dir / "report.html").read_text()

    # Every stage handled groups, and both rollout replicas shared the prompts.
    handled = {}
    for log in (run_dir / "logs").glob("*.log"):
        for line in log.read_text().splitlines():
            if '"draining"' in line:
                handled[log.stem] = json.loads(line)["handled"]
    assert handled["rollout-0"] > 0 and handled["rollout-1"] > 0, handled
    assert handled["reward-0"] > 0 and handled["reference-0"] > 0, handled
    assert handled["rollout-0"] + handled["rollout-1"] >= TOTAL_STEPS * 8

    # Checkpoints exist with manifests, and the last one is the trained model: loading its folder
    # through from_pretrained reproduces the trainer's final held-out accuracy exactly.
    store = CheckpointStore(open_store(runs.resolve().as_uri(), CheckpointConfig()), "pipe", keep_last=3)
    assert store.steps() == [5, 10]
    final_eval = [r for r in rows if r.is_eval][-1]
    assert final_eval.step == TOTAL_STEPS
    step_dir = run_dir / "step-00000010"
    reloaded = load_model(step_dir)
    eval_rows = load_jsonl(data_dir / "eval.jsonl")[:200]
    assert greedy_accuracy(reloaded, load_tokenizer(step_dir), eval_rows, 6) == final_eval[m.EVAL_ACCURACY]

    # EXPERIENCE below what the oldest kept checkpoint would re-read was purged after the saves.
    oldest = json.loads((run_dir / "step-00000005" / "trainer_state.json").read_text())["last_experience_seq"]
    trainer_log = [
        json.loads(line) for line in (run_dir / "logs" / "trainer.log").read_text().splitlines() if line.startswith("{")
    ]
    assert oldest > 0 and oldest + 1 in [e["experience_below"] for e in trainer_log if e["event"] == "purged"]

    assert (run_dir / "report.png").stat().st_size > 10_000
    assert "eval accuracy (start -> end)" in output

    # What each role used, from its processes' CPU time, and the cost at the configured price: in usage.json,
    # the summary and the report. No GPU here, so no GPU-hours.
    usage = json.loads((run_dir / "usage.json").read_text())
    assert sorted(usage["device_hours"]) == ["reference", "reward", "rollout", "trainer", "warm-start"]
    assert all(hours["cpu-core"] > 0 and hours["gpu"] == 0 for hours in usage["device_hours"].values())
    core_hours = sum(hours["cpu-core"] for hours in usage["device_hours"].values())
    assert usage["cost"] == pytest.approx(core_hours * 0.05) and usage["steps"] == TOTAL_STEPS
    assert usage["cost_per_step"] == pytest.approx(usage["cost"] / TOTAL_STEPS)
    baseline_eval = next(r for r in rows if r.is_eval)
    assert baseline_eval.step == 0
    assert usage["accuracy_gain"] == pytest.approx(final_eval[m.EVAL_ACCURACY] - baseline_eval[m.EVAL_ACCURACY])
    summary = " ".join(output.split())
    assert "device-hours: trainer" in summary and "cost per step" in summary
    assert "Devices and cost" in (run_dir / "report.html").read_text()

    # Running the same config again by accident must not destroy the run: refused, nothing touched.
    again = subprocess.run([*RLPIPE_RUN, str(config)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2, again.stderr
    assert f"{run_dir} already holds a run" in again.stderr and "--resume" in again.stderr
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-00000005", "step-00000010"]
    assert len(metric_rows(run_dir)) == len(rows)
    # --overwrite (what `make demo` passes) starts over in the same directory: the old steps and rows are gone.
    # It runs synchronously (train.synchronous): each step trains only on groups the weights just published
    # generated, and the rollouts wait for those weights rather than have their groups dropped as stale.
    short = config_file(
        tmp_path,
        tiny_model,
        "short.yaml",
        run_id="pipe",
        train={"total_steps": 2, "batch_size": 8, "learning_rate": 2e-5, "synchronous": True},
        checkpoint={"save_every_steps": 2, "keep_last": 3},
    )
    redone = subprocess.run(
        [*RLPIPE_RUN, str(short), "--overwrite"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert redone.returncode == 0, redone.stderr[-3000:]
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-00000002"]
    redone_steps = [r for r in metric_rows(run_dir) if r.is_step]
    assert [r.step for r in redone_steps] == [1, 2]
    versions = [(r[m.GENERATED_BY_VERSION_MIN], r[m.GENERATED_BY_VERSION_MAX]) for r in redone_steps]
    assert versions == [(0, 0), (1, 1)]
    assert [r[m.DROPPED_STALE] for r in redone_steps] == [0, 0]
