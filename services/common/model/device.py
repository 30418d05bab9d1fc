"""Which device ``model.device`` names on this process, decided without importing torch or transformers.

The launcher and ``rlpipe doctor`` check the setting before anything loads a model; importing the model
stack to answer would cost them seconds of CPU on every run.
"""

from __future__ import annotations

from services.common.config import ConfigError

DEVICE_NAMES = ("auto", "cpu", "cuda")


def device_name(name: str, cuda_available: bool) -> str:
    """``model.device`` as the name of a torch device: ``auto`` is ``cuda`` when this process sees a GPU, else
    ``cpu``. Checked where the model is loaded, not at config load: the launcher that validates a config may run
    on a machine without the GPU its services get."""
    if name == "auto":
        return "cuda" if cuda_available else "cpu"
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"invalid configuration:\n  model.device: {name!r} is not one of {list(DEVICE_NAMES)}")
    if name == "cuda" and not cuda_available:
        raise ConfigError(
            "invalid configuration:\n  model.device: 'cuda' but this process sees no CUDA device "
            "(torch.cuda.is_available() is False); use auto or cpu, or run it where a GPU is visible"
        )
    return name
