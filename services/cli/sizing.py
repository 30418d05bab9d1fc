"""How much memory each role of a run needs, estimated from the model's shape before anything is loaded.

A pure function of a typed :class:`ModelShape` (read from a model folder's config.json) and the run's
batch shape, so it is unit-tested against hand-computed numbers; ``rlpipe plan`` and ``rlpipe doctor``
print it. The numbers are estimates: bench/plan_check.py compares them with measured CPU peaks and
docs/performance.md records the comparison.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.common.model.gpu_share import ALLOCATOR_FLOOR_BYTES, CUDA_CONTEXT_BYTES

MIB = 1024**2
GIB = 1024**3
# Allocator fragmentation, CUDA context, temporaries the estimate leaves out: 20-30% is the usual allowance.
HEADROOM = 0.25
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# AdamW keeps two moments (exp_avg, exp_avg_sq) per trainable parameter.
ADAMW_MOMENTS = 2


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that decide its memory."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool
    head_dim: int
    qkv_bias: bool = False  # Qwen2 has biases on the q, k and v projections; Llama does not

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        attention = 2 * self.hidden * self.q_width + 2 * self.hidden * self.kv_width
        bias = self.q_width + 2 * self.kv_width if self.qkv_bias else 0
        mlp = 3 * self.hidden * self.intermediate  # gate, up and down
        norms = 2 * self.hidden
        return attention + bias + mlp + norms

    @property
    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.layers * self.layer_parameters + self.hidden  # + the final norm

    @property
    def activations_per_token_layer(self) -> int:
        """Elements one layer keeps per token for the backward pass: the two norms' inputs and outputs, the q/k/v
        projections and their rotated q/k, the attention output, and the MLP's gate, up, activation and product.
        Attention probabilities are not kept (SDPA/flash attention recompute them)."""
        return 4 * self.hidden + 3 * self.q_width + 3 * self.kv_width + 4 * self.intermediate

    @property
    def kv_elements_per_token(self) -> int:
        """Keys and values vLLM caches per token, over all layers."""
        return 2 * self.layers * self.kv_width


# The projections peft's LoRA can wrap in a decoder layer, and the default it wraps (model.lora.target_modules).
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_parameters(shape: ModelShape, rank: int, targets: tuple[str, ...] = LORA_DEFAULT_TARGETS) -> int:
    """Trainable parameters of rank-``rank`` adapters on each ``targets`` projection of every layer: rank x (in +
    out) each; a name that is not a projection of the layer is refused, naming the ones there are."""
    widths = {
        "q_proj": shape.hidden + shape.q_width,
        "k_proj": shape.hidden + shape.kv_width,
        "v_proj": shape.hidden + shape.kv_width,
        "o_proj": shape.q_width + shape.hidden,
        "gate_proj": shape.hidden + shape.intermediate,
        "up_proj": shape.hidden + shape.intermediate,
        "down_proj": shape.intermediate + shape.hidden,
    }
    unknown = [name for name in targets if name not in widths]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} are not among a layer's projections: {', '.join(widths)}")
    return rank * sum(widths[name] for name in targets) * shape.layers


def read_model_shape(folder: Path) -> ModelShape:
    """The shape in a Hugging Face model folder's config.json; a missing field is named in the error."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read a model shape from {path}: {error}") from None
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [name for name in required if name not in config]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: not a decoder-only transformer rlpipe can size")
    heads = config["num_attention_heads"]
    return ModelShape(
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        vocab=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
    )


@dataclass(frozen=True)
class SizingInputs:
    """The run's shape as far as memory goes; ``rlpipe plan`` takes it from options or a run config."""

    algorithm: str = "grpo"
    critic: Literal["separate", "head"] = "separate"  # PPO's critic: its own model, or a head on the policy
    micro_batch_tokens: int = 4096  # tokens one trainer forward/backward holds, padding included
    max_seq_len: int = 1024  # prompt plus completion (tokens)
    group_size: int = 8  # completions per prompt
    reference_groups: int = 1  # groups one reference forward pass scores together
    rollout_sequences: int = 256  # sequences one vLLM engine keeps in flight (prompts per batch x group size)
    gradient_checkpointing: bool = False
    model_dtype: str = "bfloat16"  # activations, the reference and the rollout's weights
    master_dtype: str = "float32"  # the trainer's parameters, gradients and AdamW moments
    lora_rank: int | None = None  # adapters only are trained; None = every parameter
    lora_targets: tuple[str, ...] = LORA_DEFAULT_TARGETS  # the projections that get an adapter
    kv_cache_bytes: int | None = None  # vLLM's KV cache as configured; None = what rollout_sequences need


@dataclass(frozen=True)
class TrainerMemory:
    weights: int
    gradients: int
    optimizer: int
    activations: int  # at the given gradient_checkpointing
    activations_checkpointed: int
    activations_full: int
    logits: int  # the float32 logits and log-softmax of one micro-batch
    critic: int  # PPO's separate critic model: its weights, gradients, moments and activations; 0 otherwise

    @property
    def sharded(self) -> int:
        """What FSDP2 splits across the trainer's ranks: weights, gradients and optimizer state."""
        return self.weights + self.gradients + self.optimizer

    @property
    def per_rank_unsharded(self) -> int:
        return self.activations + self.logits

    def per_rank(self, world_size: int) -> int:
        """One rank's need under FSDP2 at ``world_size`` (activations are per rank, not sharded)."""
        return -(-(self.sharded + self.critic) // world_size) + self.per_rank_unsharded

    @property
    def total(self) -> int:
        return self.per_rank(1)


@dataclass(frozen=True)
class RoleMemory:
    weights: int
    working: int  # activations and logits of a reference forward; the KV cache of a rollout

    @property
    def total(self) -> int:
        return self.weights + self.working


@dataclass(frozen=True)
class SizingEstimate:
    shape: ModelShape
    inputs: SizingInputs
    trainable_parameters: int
    trainer: TrainerMemory
    reference: RoleMemory
    rollout: RoleMemory


def with_headroom(size: int) -> int:
    return int(size * (1 + HEADROOM))


def _trainer_activations(shape: ModelShape, tokens: int, act_bytes: int, checkpointed: bool) -> int:
    full_layer = tokens * shape.activations_per_token_layer * act_bytes
    if not checkpointed:
        return shape.layers * full_layer
    # Each layer keeps only its input; one layer's activations exist again while it is recomputed.
    return shape.layers * tokens * shape.hidden * act_bytes + full_layer


def _logits(shape: ModelShape, tokens: int, act_bytes: int) -> int:
    # The logits in the compute dtype, their float32 log-softmax, and (training) its gradient of the same size.
    return tokens * shape.vocab * (act_bytes + 4 + 4)


def estimate(shape: ModelShape, inputs: SizingInputs) -> SizingEstimate:
    """Bytes each role needs, without headroom (``with_headroom`` adds it)."""
    act = DTYPE_BYTES[inputs.model_dtype]
    master = DTYPE_BYTES[inputs.master_dtype]
    params = shape.parameters
    lora = inputs.lora_rank is not None
    trainable = params if inputs.lora_rank is None else lora_parameters(shape, inputs.lora_rank, inputs.lora_targets)
    # The trainer loads the base in the master dtype either way; with adapters it is frozen and they add to it.
    weights = params * master + (trainable * master if lora else 0)
    tokens = inputs.micro_batch_tokens
    checkpointed = _trainer_activations(shape, tokens, act, checkpointed=True)
    full = _trainer_activations(shape, tokens, act, checkpointed=False)
    activations = checkpointed if inputs.gradient_checkpointing else full
    logits = _logits(shape, tokens, act)
    critic = 0
    if inputs.algorithm == "ppo" and inputs.critic == "separate":
        # A second model of the same shape, fully trained, whose value head has no vocabulary-wide logits.
        critic = params * master * (2 + ADAMW_MOMENTS) + activations
    trainer = TrainerMemory(
        weights=weights,
        gradients=trainable * master,
        optimizer=trainable * master * ADAMW_MOMENTS,
        activations=activations,
        activations_checkpointed=checkpointed,
        activations_full=full,
        logits=logits,
        critic=critic,
    )
    reference_tokens = inputs.reference_groups * inputs.group_size * inputs.max_seq_len
    # Without gradients only one layer's activations are alive at a time, but the logits cover every position.
    reference_working = reference_tokens * shape.activations_per_token_layer * act + reference_tokens * shape.vocab * (
        act + 4
    )
    reference = RoleMemory(weights=params * act, working=reference_working)
    kv_needed = inputs.rollout_sequences * inputs.max_seq_len * shape.kv_elements_per_token * act
    rollout = RoleMemory(
        weights=params * act, working=kv_needed if inputs.kv_cache_bytes is None else inputs.kv_cache_bytes
    )
    return SizingEstimate(shape, inputs, trainable, trainer, reference, rollout)


@dataclass(frozen=True)
class Placement:
    """One way to lay the roles over the GPUs at hand, and whether it fits."""

    name: str
    fits: bool
    trainer_world_size: int  # FSDP2 ranks; 0 when no world size fits
    gpus_used: int
    detail: str


def rollout_on_cpu(est: SizingEstimate) -> int:
    """The rollout's need on vLLM's CPU backend, which packs each linear layer's weight for oneDNN's kernels and
    keeps the original beside it: its weights count twice (bench/plan_check.py measured SmolLM2's engine at 0.50x
    the one-copy estimate, 1.0x with both)."""
    return est.rollout.total + est.rollout.weights


def placements(est: SizingEstimate, gpus: int, gpu_bytes: int) -> list[Placement]:
    """Everything on one GPU, the reference on the trainer's first rank, or the reference on its own GPU; each
    with the smallest FSDP2 world size whose per-rank need (with headroom) fits. One rollout engine per GPU."""
    trainer, reference, rollout = est.trainer, est.reference, est.rollout

    def fits(size: int) -> bool:
        return with_headroom(size) <= gpu_bytes

    result = []
    alone = trainer.total + reference.total + rollout.total
    result.append(
        Placement(
            "all roles on one GPU",
            gpus >= 1 and fits(alone),
            1 if fits(alone) else 0,
            1,
            f"needs {gib(with_headroom(alone))} on one GPU",
        )
    )
    for name, reference_own_gpu in (("reference beside trainer rank 0", False), ("reference on its own GPU", True)):
        others = 1 + int(reference_own_gpu)  # the rollout's GPU, and the reference's if it has one
        if gpus <= others:
            result.append(Placement(name, False, 0, others + 1, f"needs at least {others + 1} GPUs"))
            continue
        rank0_extra = 0 if reference_own_gpu else reference.total
        world = next((w for w in range(1, gpus - others + 1) if fits(trainer.per_rank(w) + rank0_extra)), 0)
        ok = world > 0 and fits(rollout.total) and (not reference_own_gpu or fits(reference.total))
        shown = world or gpus - others  # the largest world size tried, when none fits
        detail = (
            f"trainer {shown} rank(s) at {gib(with_headroom(trainer.per_rank(shown) + rank0_extra))} on rank 0, "
            f"rollout {gib(with_headroom(rollout.total))}"
            + (f", reference {gib(with_headroom(reference.total))}" if reference_own_gpu else "")
        )
        result.append(Placement(name, ok, world, shown + others, detail))
    return result


# The roles of the "one GPU shared" placement, each process with its share of the GPU's memory.
SHARED_GPU_ROLES = ("trainer", "reference", "rollout")


@dataclass(frozen=True)
class SharedGpu:
    """The "one GPU shared" placement: the trainer, the reference's replicas and as many rollout replicas as fit on
    one GPU, each process with its share of the GPU's memory (``service.gpu_memory_fraction``)."""

    gpu_bytes: int
    shares: dict[str, float]  # role -> its share of the GPU, per process: the config's where it set one
    given: tuple[str, ...]  # the roles whose share the config set; the others' are this plan's
    reserved: float  # shares the config gave roles this plan does not size (a reward model), all replicas
    reference_replicas: int
    fitting: int  # rollout replicas the memory left after the others holds
    rollout_replicas: int  # what `rollout.replicas: auto` starts: fitting, at most rollout.auto_max_replicas

    @property
    def fits(self) -> bool:
        return self.rollout_replicas >= 1

    @property
    def claimed(self) -> float:
        """The shares of every process together, with the replicas auto starts."""
        return (
            self.reserved
            + self.shares["trainer"]
            + self.shares["reference"] * self.reference_replicas
            + self.shares["rollout"] * self.rollout_replicas
        )


def gpu_share(need: int, gpu_bytes: int) -> float:
    """A process's share of a GPU of ``gpu_bytes`` for its own ``need``: the need with headroom, the allocator's
    floor (``ALLOCATOR_FLOOR_BYTES``) and a CUDA context (``CUDA_CONTEXT_BYTES``), over the GPU's memory, rounded
    up to a thousandth so it never falls short (a share a float's last bit above a thousandth is that thousandth)."""
    held = with_headroom(need) + ALLOCATOR_FLOOR_BYTES + CUDA_CONTEXT_BYTES
    return math.ceil(held / gpu_bytes * 1000 - 1e-9) / 1000


def shared_gpu(
    est: SizingEstimate,
    gpu_bytes: int,
    reference_replicas: int = 1,
    given: Mapping[str, float] | None = None,
    max_replicas: int = 4,
    reward_replicas: int = 1,
) -> SharedGpu:
    """How many rollout replicas fit on one GPU beside the trainer and ``reference_replicas`` references.

    Each role's share is ``given``'s (service.gpu_memory_fraction) or ``gpu_share`` of its estimate; a given reward
    share counts ``reward_replicas`` times. The rollout replicas that fit are
    ``floor((1 - reward - trainer - reference x replicas) / rollout)``, and auto starts at most ``max_replicas``.
    The memory no process claims stays free."""
    given = dict(given or {})
    needs = {"trainer": est.trainer.total, "reference": est.reference.total, "rollout": est.rollout.total}
    shares = {role: given.get(role) or gpu_share(need, gpu_bytes) for role, need in needs.items()}
    reserved = given.get("reward", 0.0) * reward_replicas
    left = 1 - reserved - shares["trainer"] - shares["reference"] * reference_replicas
    # A thousandth's rounding must not cost a replica that fits exactly.
    fitting = max(math.floor(left / shares["rollout"] + 1e-9), 0)
    return SharedGpu(
        gpu_bytes,
        shares,
        tuple(role for role in SHARED_GPU_ROLES if role in given),
        reserved,
        reference_replicas,
        fitting,
        min(fitting, max_replicas),
    )


@dataclass(frozen=True)
class HostMemory:
    """What /proc/meminfo says about the host's memory and swap (bytes)."""

    total: int
    available: int
    swap_total: int
    swap_free: int

    @property
    def swap_used(self) -> int:
        return self.swap_total - self.swap_free


def parse_meminfo(text: str) -> HostMemory:
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields:
            values[name] = int(fields[0]) * 1024  # /proc/meminfo counts kB (KiB)
    return HostMemory(
        values.get("MemTotal", 0), values.get("MemAvailable", 0), values.get("SwapTotal", 0), values.get("SwapFree", 0)
    )


def read_host_memory(path: Path = Path("/proc/meminfo")) -> HostMemory | None:
    """None where the host has no /proc/meminfo (macOS): no swap warning then."""
    try:
        return parse_meminfo(path.read_text())
    except OSError:
        return None


def swap_in_use(host: HostMemory | None) -> str | None:
    """A note when the host already pages: a step that touches swapped-out memory runs many times slower."""
    if host is None or host.swap_used <= 0:
        return None
    return f"{gib(host.swap_used)} of swap already in use"


def memory_shortfall(host: HostMemory | None, host_need: int) -> str | None:
    """Why this host would swap (or, without swap, be killed): it needs more than is available."""
    if host is None or with_headroom(host_need) <= host.available:
        return None
    swap = f"it would swap, {gib(host.swap_free)} swap free" if host.swap_free else "no swap: OOM"
    return f"host memory: {gib(with_headroom(host_need))} needed, {gib(host.available)} available ({swap})"


def gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB / 10 else f"{size / MIB:.1f} MiB"
