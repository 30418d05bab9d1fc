"""What this machine offers a role: free ports, the device ``model.device`` names, a box for model-written code."""

from __future__ import annotations

import socket
from collections.abc import Callable

from services.common.config import ConfigError, ModelConfig, RolloutConfig, RunConfig
from services.common.episodes.environments import box_available
from services.common.model.device import device_name
from services.common.observe.hardware import GpuFacts, gpu_facts, gpu_seen, release_numbers
from services.common.startup_checks.rows import CheckResult


def check_ports(host: str, ports: dict[str, int]) -> CheckResult:
    """Each fixed port can be bound on ``host``; 0 means any free port and is not probed."""
    fixed = {field: port for field, port in ports.items() if port}
    if not fixed:
        return CheckResult("ports", "skip", "every port is 0 (any free port)")
    busy = []
    for field, port in fixed.items():
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            with socket.socket(family, kind, proto) as sock:
                # As the servers do, so a port in TIME_WAIT counts as free.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
        except OSError as error:  # socket.gaierror included: an unresolvable host binds nothing
            busy.append(f"{field} {port} on {host}: {error.strerror or error}")
    if busy:
        return CheckResult("ports", "fail", "; ".join(busy))
    return CheckResult(
        "ports", "ok", f"free on {host}: " + ", ".join(f"{field}={port}" for field, port in fixed.items())
    )


def role_ports(cfg: RunConfig, role: str) -> dict[str, int]:
    """The fixed ports ``role`` binds.

    ``run``: those its children bind that the launcher does not choose; ``doctor``: all of them.
    """
    ports = {"telemetry.metrics_port": cfg.telemetry.metrics_port}
    if role == "trainer":
        ports |= {"service.trainer_grpc_port": cfg.service.trainer_grpc_port, "admin.port": cfg.admin.port}
    elif role == "run":
        # The launcher picks free ports for WeightSync, and for admin unless the config names one.
        if "port" in cfg.admin.model_fields_set:
            ports |= {"admin.port": cfg.admin.port}
    elif role == "doctor":
        ports |= {
            "service.trainer_grpc_port": cfg.service.trainer_grpc_port,
            "service.grpc_port": cfg.service.grpc_port,
            "admin.port": cfg.admin.port,
        }
    else:
        ports |= {"service.grpc_port": cfg.service.grpc_port}
    return ports


def check_python_box(rollout: RolloutConfig, probe_box: Callable[[], str | None] = box_available) -> list[CheckResult]:
    """With ``rollout.environment: python``: can this machine build the box model-written code runs in? No row for
    another environment. Without a box, a failure (``required``) or a warning (``allow_unisolated``)."""
    if rollout.environment != "python":
        return []
    name = "python tool box"
    reason = probe_box()
    if reason is None:
        detail = "model-written code runs in new user, PID, network and mount namespaces behind a system-call filter"
        return [CheckResult(name, "ok", detail)]
    if rollout.python_tool_isolation == "allow_unisolated":
        detail = f"no box here ({reason}): model-written code runs unboxed, as rollout.python_tool_isolation allows"
        return [CheckResult(name, "warn", detail)]
    return [
        CheckResult(
            name,
            "fail",
            f"no box for model-written code can be built here: {reason}; it needs unprivileged user namespaces on "
            'x86_64 or aarch64 (docs/agents.md, "The box"), or set rollout.python_tool_isolation: '
            "allow_unisolated to run it unboxed",
        )
    ]


def cuda_failure(facts: GpuFacts) -> str:
    """Why CUDA does not initialize on a machine that has a GPU, with what to do about it."""
    if facts.torch_cuda is None:
        return (
            f"torch {facts.torch_version} is a CPU-only build (torch.version.cuda is None); "
            "install a CUDA build of torch (deploy/requirements-cuda.txt)"
        )
    if facts.driver_cuda is not None and release_numbers(facts.driver_cuda)[:1] < release_numbers(facts.torch_cuda)[:1]:
        return (
            f"torch {facts.torch_version} is built for CUDA {facts.torch_cuda} but driver "
            f"{facts.driver_version or '(version unknown)'} supports CUDA up to {facts.driver_cuda}; "
            "upgrade the driver or install a torch built for the driver's CUDA"
        )
    if facts.cuda_error:
        return f"torch.cuda.init() raised {facts.cuda_error}"
    return "torch.cuda.is_available() is False and torch.cuda.init() raised nothing"


def device_result(name: str, cuda_available: bool, broken_gpu: GpuFacts | None) -> CheckResult:
    """``model.device`` against what this process has.

    ``broken_gpu``: the facts of a GPU that is present but that CUDA cannot open (None when there
    is none, or CUDA works). With it, ``auto`` fails instead of quietly training on the CPU.
    """
    broken = (
        f"a GPU is present ({broken_gpu.gpu_seen}) but CUDA does not initialize: {cuda_failure(broken_gpu)}"
        if broken_gpu is not None
        else ""
    )
    try:
        device = device_name(name, cuda_available)
    except ConfigError as error:
        detail = str(error).removeprefix("invalid configuration:").strip()
        return CheckResult("device", "fail", f"{detail}; {broken}" if broken else detail)
    if broken and name == "auto":
        return CheckResult(
            "device", "fail", f"model.device auto would run on the CPU: {broken}; or set model.device cpu on purpose"
        )
    return CheckResult("device", "ok", f"model.device {name}: {device}")


def check_device(model: ModelConfig) -> CheckResult:
    """``model.device`` names a device this process has (``cuda`` with no GPU is refused here, not mid-load).

    CUDA needs a GPU that the driver shows, so torch (seconds of CPU to import) is asked only where ``gpu_seen``
    finds one: a stat of /proc first, at worst nvidia-smi and NVML.
    """
    if not gpu_seen():
        return device_result(model.device, cuda_available=False, broken_gpu=None)
    import torch

    available = torch.cuda.is_available()
    broken = gpu_facts() if not available and model.device != "cpu" else None
    return device_result(model.device, available, broken)
