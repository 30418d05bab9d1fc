"""Recovery times of a live run: SIGKILL the trainer, then a rollout, and time the way back.

- trainer kill -> next applied step (restart, resume from the checkpoint, re-read EXPERIENCE);
- rollout kill -> its replacement ready, and -> the next applied step (the prompts it held
  are redelivered once nats.ack_wait_s has passed: a dead replica cannot say it gave up);
- for scale, the run's median step time, measured in the same run.

    python -m bench.recovery [--model build/test-model/model --data build/test-model/data]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from services.common.observe import metrics as m
from services.common.observe.records import MetricsRow, read_jsonl, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def rows(run_dir: Path, name: str) -> list[dict]:
    return read_jsonl(run_dir / name)


def steps(run_dir: Path) -> list[MetricsRow]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r.is_step]


def wait(condition, what: str, launcher: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if launcher.poll() is not None:
            raise RuntimeError(f"rlpipe run exited with {launcher.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def kill(run_dir: Path, name: str) -> float:
    os.kill(json.loads((run_dir / "run.json").read_text())["pids"][name], signal.SIGKILL)
    return time.time()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=ROOT / "build/test-model/model")
    parser.add_argument("--data", type=Path, default=ROOT / "build/test-model/data")
    parser.add_argument("--ack-wait", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        config = Path(tmp) / "c.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "run_id": "recovery",
                    "runs_dir": str(runs),
                    "model": {"path": str(args.model)},
                    "data": {"train_path": str(args.data / "train.jsonl"), "eval_every_steps": 0},
                    "sampling": {"group_size": 4, "max_new_tokens": 6},
                    "train": {"total_steps": 2000, "batch_size": 8, "learning_rate": 1e-5, "max_seq_len": 32},
                    "checkpoint": {"save_every_steps": 5, "keep_last": 3},
                    "nats": {
                        "ack_wait_s": args.ack_wait,
                        "heartbeat_s": args.ack_wait / 3,
                        "max_deliver": 5,
                        "duplicate_window_s": 600,
                    },
                    "rollout": {"prompts_per_batch": 8},
                    "supervision": {"backoff_s": 0.1},
                }
            )
        )
        run_dir = runs / "recovery"
        launcher = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "run", str(config)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait(lambda: len(steps(run_dir)) >= 12, "first steps", launcher)
            step_time = statistics.median(
                b[m.TIME] - a[m.TIME] for a, b in zip(steps(run_dir)[-10:], steps(run_dir)[-9:], strict=False)
            )

            killed = kill(run_dir, "trainer")
            wait(lambda: steps(run_dir)[-1][m.TIME] > killed, "a step after the trainer kill", launcher)
            trainer_back = next(r[m.TIME] for r in steps(run_dir) if r[m.TIME] > killed) - killed

            wait(lambda: len([r for r in steps(run_dir) if r[m.TIME] > killed]) >= 5, "steady steps", launcher)
            killed = kill(run_dir, "rollout-0")
            wait(
                lambda: any(
                    e.get("event") == "ready" and e["ts"] > killed
                    for e in rows(run_dir / "logs", "rollout-0.log")
                    if "ts" in e
                ),
                "rollout ready",
                launcher,
            )
            rollout_ready = (
                next(
                    e["ts"]
                    for e in rows(run_dir / "logs", "rollout-0.log")
                    if e.get("event") == "ready" and e["ts"] > killed
                )
                - killed
            )
            wait(lambda: steps(run_dir)[-1][m.TIME] > killed, "a step after the rollout kill", launcher)
            rollout_step = next(r[m.TIME] for r in steps(run_dir) if r[m.TIME] > killed) - killed
        finally:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=120)
    print(f"median step time:                       {step_time:6.2f} s")
    print(
        f"trainer SIGKILL -> next applied step:    {trainer_back:6.2f} s  ({trainer_back / step_time:.0f} step times)"
    )
    print(f"rollout SIGKILL -> replacement ready:    {rollout_ready:6.2f} s")
    print(f"rollout SIGKILL -> next applied step:    {rollout_step:6.2f} s")
    print(f"prompts it held: redelivered after nats.ack_wait_s = {args.ack_wait:.0f} s")


if __name__ == "__main__":
    main()
