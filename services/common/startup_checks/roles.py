"""Which checks each role runs before it starts, and the entry point that runs them and refuses on a failure."""

from __future__ import annotations

from services.common.config import RunConfig
from services.common.startup_checks.folders import dataset_rows, model_rows
from services.common.startup_checks.machine import check_device, check_ports, check_python_box, role_ports
from services.common.startup_checks.rows import Check, CheckResult, StartupCheckError, run_each
from services.common.startup_checks.storage import storage_rows
from services.common.startup_checks.tokens import check_admin_read_token, check_admin_token, check_weight_sync_token

STARTUP_DATASET_LINES = 1_000

STARTUP_ROLES = ("trainer", "rollout", "reward", "reference", "run")


def _startup_checks(role: str, resume: bool = False) -> list[Check]:
    ports = Check(
        "ports", ("service", "admin", "telemetry"), lambda cfg: [check_ports(cfg.service.host, role_ports(cfg, role))]
    )
    policy = Check("model", ("model",), lambda cfg: model_rows(cfg, policy=True, reference=False))
    dataset = Check("dataset", ("data",), lambda cfg: dataset_rows(cfg.data, STARTUP_DATASET_LINES))
    storage = Check("storage", ("checkpoint",), lambda cfg: storage_rows(cfg, resume))
    token = Check(
        "admin token",
        ("admin",),
        lambda cfg: [check_admin_token(cfg, launcher_generates=role == "run"), *check_admin_read_token(cfg)],
    )
    device = Check("device", ("model",), lambda cfg: [check_device(cfg.model)])
    # The rollout plays episodes, the trainer its held-out ones: both run the Python tool.
    box = Check("python tool box", ("rollout",), lambda cfg: check_python_box(cfg.rollout))
    weight_sync = Check("weight-sync token", (), lambda cfg: [check_weight_sync_token()])
    if role == "trainer":
        return [policy, device, dataset, storage, token, weight_sync, box, ports]
    if role == "rollout":
        return [policy, weight_sync, box, ports]
    if role == "reference":
        return [
            Check("model", ("model", "reference"), lambda cfg: model_rows(cfg, policy=False, reference=True)),
            device,
            ports,
        ]
    if role == "reward":
        return [ports]
    both = Check("model", ("model", "reference"), lambda cfg: model_rows(cfg, policy=True, reference=True))
    return [both, device, dataset, storage, token, weight_sync, box, ports]


def startup_checks(cfg: RunConfig, role: str, resume: bool = False) -> list[CheckResult]:
    """The cheap checks ``role`` needs before it starts (no network wait beyond a few seconds, no broker).

    trainer: model, datasets, storage probe, admin token (required: it does not start without one) and the read-only
    admin token when one is set, weight-sync token (sendable when set), the Python tool's box (with
    ``rollout.environment: python``), its ports; rollout: model, weight-sync token, the box, ports; reference:
    reference model, ports; reward: ports; run (the launcher): models, datasets, storage, admin token (a warning: it
    generates one, except in prod), weight-sync token, the box, admin and metrics ports. The broker is left out: the
    bus waits for it, and ``rlpipe run`` starts its own after these checks.
    ``resume``: the run goes on from its checkpoints (a restart, ``rlpipe run --resume``), so a store out of reach
    is an outage the resume waits out, not a refusal (``check_storage``).
    Returns the rows (warnings included); raises StartupCheckError naming each failure.
    """
    if role not in STARTUP_ROLES:
        raise ValueError(f"unknown role {role!r}: one of {STARTUP_ROLES}")
    results = run_each(_startup_checks(role, resume), cfg, frozenset())
    failures = [result for result in results if result.failed]
    if failures:
        raise StartupCheckError(role, failures)
    return results
