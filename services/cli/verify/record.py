"""What ``verify.json`` keeps besides the checks, so a verification is a baseline for later changes (the guide's
deployment record): the build and library versions, the config snapshot with secrets redacted, the smoke run's
first metrics and the conclusion in one sentence."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

from services.cli.verify.check import Check
from services.common.config import BuildInfo, RunConfig, redacted_dump
from services.common.observe import metrics as m
from services.common.observe.records import MetricsRow

# The libraries whose versions decide how a run behaves: the engine, the trainer's math, the transports.
LIBRARIES = ("torch", "transformers", "vllm", "safetensors", "numpy", "nats-py", "minio", "grpcio", "pydantic")
# Per step, the numbers a later verification is compared with.
FIRST_RUN_METRICS = (
    m.STEP,
    m.LOSS,
    m.ENTROPY,
    m.REWARD_MEAN,
    m.REWARD_STD,
    m.KL_REF,
    m.RESPONSE_LENGTH_MEAN,
    m.TERMINATION_RATE,
    m.STEP_TIME_S,
    m.TOKENS_PER_S,
    m.HOST_RSS_GB,
)


def library_versions() -> dict[str, str]:
    """Installed version of each of ``LIBRARIES`` and Python's; ``absent`` for one not installed (vLLM on CPU)."""
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def build() -> dict[str, str]:
    info = BuildInfo().resolved()
    return {"version": info.version, "revision": info.revision}


def first_run_metrics(rows: list[MetricsRow]) -> list[dict[str, float]]:
    """The smoke run's step rows cut to ``FIRST_RUN_METRICS`` (the numbers a row has), by row key."""
    return [
        {metric.key: value for metric in FIRST_RUN_METRICS if (value := row.get(metric)) is not None} for row in rows
    ]


def conclusion(checks: list[Check]) -> str:
    """One sentence: passed (with what was skipped), or which checks failed and the first one's evidence."""
    failed = [c for c in checks if c.status == "fail"]
    skipped = [c.name for c in checks if c.status == "skip"]
    if failed:
        return (
            f"failed: {', '.join(c.name for c in failed)} ({failed[0].name}: {failed[0].detail[:300]}); "
            "fix before the deployment takes a run"
        )
    passed = f"passed all {len(checks) - len(skipped)} checks that ran"
    return passed + (f"; skipped: {', '.join(skipped)}" if skipped else "") + "; keep this record as the baseline"


def record_extras(cfg: RunConfig, rows: list[MetricsRow], checks: list[Check]) -> dict[str, Any]:
    """The fields ``verify.json`` carries beside its checks."""
    return {
        "build": build(),
        "libraries": library_versions(),
        "config": redacted_dump(cfg),
        "first_run_metrics": first_run_metrics(rows),
        "conclusion": conclusion(checks),
    }
