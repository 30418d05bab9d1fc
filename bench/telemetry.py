"""What recording a trainer step costs: OpenTelemetry gauges against writing the same row to metrics.jsonl.

The trainer does both after every step, on the event loop; the claim "recording never
blocks the training step" holds when both are tiny next to a step (tens of ms here).
Prints microseconds per row for each and their ratio, measured in the same run.

    python -m bench.telemetry [--rows 20000]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from services.common.config import RunConfig, ServiceConfig, TelemetryConfig
from services.common.observe.instruments import TrainerMetrics
from services.common.observe.metrics import TRAINER_STEP_KEYS
from services.common.observe.telemetry import start_telemetry


def step_rows(count: int) -> list[dict[str, float]]:
    rng = random.Random(0)
    return [{"step": step, **{key: rng.random() for key in TRAINER_STEP_KEYS}} for step in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20000)
    args = parser.parse_args()
    rows = step_rows(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        # Only the sections telemetry reads; a full config would need a model and data on disk.
        cfg = RunConfig.model_construct(run_id="bench", service=ServiceConfig(), telemetry=TelemetryConfig())
        start_telemetry(cfg, "trainer", "bench")
        metrics = TrainerMetrics()
        started = time.perf_counter()
        for row in rows:
            metrics.record_step(row)
        otel_us = (time.perf_counter() - started) / len(rows) * 1e6

        with (Path(tmp) / "metrics.jsonl").open("a", buffering=1) as out:
            started = time.perf_counter()
            for row in rows:
                out.write(json.dumps({"time": time.time(), **row}) + "\n")
            jsonl_us = (time.perf_counter() - started) / len(rows) * 1e6
    print(f"rows: {len(rows)} of {len(rows[0])} metrics")
    print(f"OpenTelemetry record_step: {otel_us:8.1f} us/row")
    print(f"metrics.jsonl line (base):  {jsonl_us:8.1f} us/row")
    print(f"ratio (otel / jsonl): {otel_us / jsonl_us:.2f}")


if __name__ == "__main__":
    main()
