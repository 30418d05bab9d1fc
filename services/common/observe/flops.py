"""Model FLOPs utilization (MFU): the share of a device's peak that the learner's step did in model arithmetic.

    flops(step) = passes x sum over the step's sequences s of (6 N T_s + 12 L d T_s^2)
    mfu         = flops(step) / (step seconds x devices x peak FLOP/s)

N the model's parameters, L its layers, d its attention width (heads x head dim), T_s a sequence's length (prompt
and response), ``passes`` the times the step goes over its batch (``train.epochs``). 6 N per token is the forward
(2 N) and backward (4 N) matrix products; 12 L d T per token is attention's scores and weighted sums, forward and
backward (PaLM, arXiv:2204.02311, appendix B, as nanoGPT's ``estimate_mfu`` counts it). These are model FLOPs,
not the hardware's: recomputation (gradient checkpointing, the old-logprob pass) and padding do not count, so the
figure compares settings. Like those sources it counts the LM head at every position and every weight's
gradient, while the learner computes logits for the response alone and, with LoRA, gradients for the adapters
alone: with long prompts or with LoRA it reads high.

The peak is the device's dense bfloat16 tensor-core rate (``BF16_PEAK_FLOPS``, the vendors' data sheets); a device
not in the table, a CPU, or a step computing in float32 has no MFU, and the ``perf/mfu`` key is then absent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Dense bfloat16 peaks (FLOP/s, no structured sparsity), by a name the device's name contains; the longest match wins,
# so "NVIDIA H100 PCIe" is the PCIe card's and "NVIDIA H100 80GB HBM3" the SXM module's. The NVL cards (PCIe, lower
# clocks and power) are rated 1,671 TFLOPS with sparsity, half that dense.
BF16_PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H200 NVL": 835e12,
    "H100": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "A100": 312e12,
}


def device_peak_flops(device_name: str) -> float | None:
    """The dense bfloat16 peak of the device named ``device_name`` (``torch.cuda.get_device_name``); None for a
    device the table does not know."""
    known = [name for name in BF16_PEAK_FLOPS if name in device_name]
    return BF16_PEAK_FLOPS[max(known, key=len)] if known else None


def step_flops(
    parameters: int, layers: int, attention_width: int, sequence_lengths: Iterable[int], passes: int = 1
) -> float:
    """Model FLOPs of a training step over sequences of ``sequence_lengths`` tokens, ``passes`` times (see the
    module docstring)."""
    per_pass = sum(6 * parameters * t + 12 * layers * attention_width * t * t for t in sequence_lengths)
    return float(passes * per_pass)


def model_flops_utilization(flops: float, seconds: float, peak_flops: float, devices: int = 1) -> float:
    """``flops`` over what ``devices`` devices of ``peak_flops`` could do in ``seconds``."""
    return flops / (max(seconds, 1e-9) * devices * peak_flops)


@dataclass(frozen=True)
class ModelArithmetic:
    """What a decoder's step FLOPs depend on: its parameters, layers and attention width."""

    parameters: int
    layers: int
    attention_width: int

    def step_flops(self, sequence_lengths: Iterable[int], passes: int = 1) -> float:
        return step_flops(self.parameters, self.layers, self.attention_width, sequence_lengths, passes)


def model_arithmetic(config: Any, parameters: int) -> ModelArithmetic:
    """A Hugging Face model config's layers and attention width (``head_dim``, else hidden / heads), with the
    model's parameter count."""
    config = getattr(config, "text_config", None) or config  # multimodal configs nest the language model's
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelArithmetic(parameters, config.num_hidden_layers, heads * head_dim)
