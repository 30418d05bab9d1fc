"""What ``verify.json`` keeps besides the checks, so a verification is a baseline for later changes (the guide's
deployment record): the build and library versions, the config snapshot with secrets redacted, the smoke run's
first metrics and the conclusion in one sentence."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

from services.cli.verify.check import Check
from services.common.config import BuildInfo, RunConfig, redacted_dump

# The libraries whose versions decide how a run behaves: the engine, the trainer's math, the transports.
LIBRARIES = ("torch", "transformers", "vllm", "safetensors", "numpy", "nats-py", "minio", "grpcio", "pydantic")
# Per step, the numbers a later verification is compared with.
FIRST_RUN_KEYS = (
    "step",
    "loss",
    "entropy",
    "reward_mean",
    "reward_std",
    "kl_ref",
    "response_length_mean",
    "termination_rate",
    "step_time_s",
    "tokens_per_s",
    "memory/host_rss_gb",
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


def first_run_metrics(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The smoke run's step rows cut to ``FIRST_RUN_KEYS`` (those a row has)."""
    return [{key: row[key] for key in FIRST_RUN_KEYS if key in row} for row in rows]


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


def record_extras(cfg: RunConfig, rows: list[dict[str, Any]], checks: list[Check]) -> dict[str, Any]:
    """The fields ``verify.json`` carries beside its checks."""
    return {
        "build": build(),
        "libraries": library_versions(),
        "config": redacted_dump(cfg),
        "first_run_metrics": first_run_metrics(rows),
        "conclusion": conclusion(checks),
    }
