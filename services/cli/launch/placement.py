"""Where ``rlpipe run`` puts its roles, and how many rollout replicas it starts.

With a count in ``rollout.replicas`` it starts that many and changes nothing else: each role inherits the launcher's
GPUs and keeps whatever ``service.gpu_memory_fraction`` says. With ``rollout.replicas: auto`` it follows
``rlpipe plan``'s "one GPU shared" placement (services/cli/sizing.py ``shared_gpu``): every role on the first GPU
the launcher sees (``CUDA_VISIBLE_DEVICES`` set to it in each role), as many rollout replicas as fit beside the
trainer and the reference (at most ``rollout.auto_max_replicas``), and every role started with its share of the
GPU's memory (the config's shares where it set them, the plan's for the rest), which the role applies at start
(services/common/model/gpu_share.py). Without a GPU, or with ``model.device: cpu``, auto is one replica.

The GPU's memory is read from NVML, which opens no CUDA context in the launcher; where NVML is missing, from
torch. A ``CUDA_VISIBLE_DEVICES`` index is taken as NVML's index (they agree unless ``CUDA_DEVICE_ORDER`` says
otherwise; name the GPU by UUID to be exact).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.cli.plan import CPU_AUTO_REPLICAS, inputs_from_config, sharing_from_config
from services.cli.sizing import SizingEstimate, estimate, gib, read_model_shape
from services.common.config import ConfigError, RunConfig
from services.common.observe.hardware import initialized_nvml


@dataclass(frozen=True)
class RunPlacement:
    """The rollout replicas a run starts, and what every role is started with to share one GPU."""

    rollout_replicas: int
    summary: str  # one line for the console: how the count was decided
    shares: dict[str, float] = field(default_factory=dict)  # service.gpu_memory_fraction per role; {}: as configured
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES of every role; None: the launcher's own
    decided: bool = False  # auto decided the count: the roles are told it (their configs say auto)

    def env(self) -> dict[str, str]:
        """The environment every role is started (and restarted) with for this placement."""
        env = {}
        if self.decided:
            env["RLPIPE_ROLLOUT__REPLICAS"] = str(self.rollout_replicas)
        if self.shares:
            env["RLPIPE_SERVICE__GPU_MEMORY_FRACTION"] = json.dumps(self.shares, sort_keys=True)
        if self.visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.visible_devices
        return env


def shared_device(visible: str | None) -> str:
    """The GPU every role shares, as CUDA_VISIBLE_DEVICES names it: the first the launcher sees ("0" when the
    launcher's own CUDA_VISIBLE_DEVICES is unset)."""
    if visible is None:
        return "0"
    return visible.split(",")[0].strip()


def decide_placement(
    cfg: RunConfig, est: SizingEstimate | None, gpu_bytes: int | None, visible: str | None
) -> RunPlacement:
    """The placement of ``cfg``'s roles, given its estimate (None when ``rollout.replicas`` is a count) and the
    memory of the GPU the roles would share (None: no GPU). Raises ConfigError naming ``rollout.replicas`` when auto
    finds no room for one rollout replica on the GPU."""
    replicas = cfg.rollout.replicas
    if replicas != "auto":
        return RunPlacement(replicas, f"{replicas} rollout replica(s), as rollout.replicas says")
    if gpu_bytes is None or cfg.model.device == "cpu" or est is None:
        return RunPlacement(
            CPU_AUTO_REPLICAS,
            f"rollout.replicas: auto without a GPU: {CPU_AUTO_REPLICAS} rollout replica (replicas on one CPU share "
            "its cores)",
            decided=True,
        )
    plan = sharing_from_config(cfg).plan(est, gpu_bytes)
    if not plan.fits:
        raise ConfigError(
            f"invalid configuration:\n  rollout.replicas: auto found no room for one rollout replica on a GPU of "
            f"{gib(gpu_bytes)} beside the trainer ({plan.shares['trainer']:.3f}) and "
            f"{plan.reference_replicas} reference(s) ({plan.shares['reference']:.3f} each); a replica needs "
            f"{plan.shares['rollout']:.3f} (`rlpipe plan` shows the estimate): give rollout.replicas a count and "
            "place the roles yourself, or lower the shares in service.gpu_memory_fraction"
        )
    device = shared_device(visible)
    shares = {**cfg.service.gpu_memory_fraction, **plan.shares}
    said = ", ".join(f"{role} {share:.3f}" for role, share in sorted(shares.items()))
    return RunPlacement(
        plan.rollout_replicas,
        f"rollout.replicas: auto: one GPU shared (CUDA_VISIBLE_DEVICES={device}, {gib(gpu_bytes)}): trainer, "
        f"{plan.reference_replicas} reference(s) and {plan.rollout_replicas} rollout replica(s) of the "
        f"{plan.fitting} that fit; shares per process: {said}",
        shares,
        device,
        decided=True,
    )


def gpu_memory(visible: str | None, nvml: Any | None, torch_total: Callable[[], int | None]) -> int | None:
    """The memory of the GPU the roles would share (``shared_device(visible)``), from NVML (``nvml``, initialized)
    or else ``torch_total()``; None when this machine shows no GPU."""
    if visible is not None and not shared_device(visible):
        return None  # CUDA_VISIBLE_DEVICES="" hides every GPU
    device = shared_device(visible)
    if nvml is not None:
        try:
            if device.startswith(("GPU-", "MIG-")):
                handle = nvml.nvmlDeviceGetHandleByUUID(device)
            else:
                handle = nvml.nvmlDeviceGetHandleByIndex(int(device))
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        except (nvml.NVMLError, ValueError):
            pass  # a device NVML cannot open: torch may still see it
    return torch_total()


def torch_gpu_memory() -> int | None:
    """GPU 0's memory as torch sees it; None without CUDA. Imports torch: only asked where NVML could not say."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def place_roles(cfg: RunConfig, visible: str | None) -> RunPlacement:
    """``decide_placement`` for this machine: the estimate from the model folder's config.json, the GPU from
    NVML or torch; ``visible`` is the launcher's CUDA_VISIBLE_DEVICES."""
    if cfg.rollout.replicas != "auto" or cfg.model.device == "cpu":
        return decide_placement(cfg, None, None, visible)
    gpu_bytes = gpu_memory(visible, initialized_nvml(), torch_gpu_memory)
    if gpu_bytes is None:
        return decide_placement(cfg, None, None, visible)
    try:
        est = estimate(read_model_shape(Path(cfg.model.path)), inputs_from_config(cfg))
    except ValueError as error:
        raise ConfigError(
            f"invalid configuration:\n  rollout.replicas: auto sizes the roles from the model's config.json, and "
            f"{error}: give rollout.replicas a count"
        ) from None
    return decide_placement(cfg, est, gpu_bytes, visible)
