"""``rlpipe plan``: the memory each role needs and which placement fits the GPUs at hand, before starting.

The estimate itself is services/cli/sizing.py (a pure function of the model's shape); this
module turns a run config or command-line options into its inputs, renders it, and gives ``rlpipe doctor``
its one "sizing" row for the configured run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from services.cli.output import print_json
from services.cli.sizing import (
    GIB,
    LORA_DEFAULT_TARGETS,
    MIB,
    SHARED_GPU_ROLES,
    HostMemory,
    Placement,
    SharedGpu,
    SizingEstimate,
    SizingInputs,
    estimate,
    gib,
    memory_shortfall,
    placements,
    read_host_memory,
    read_model_shape,
    rollout_on_cpu,
    shared_gpu,
    swap_in_use,
    with_headroom,
)
from services.common.config import RolloutConfig, RunConfig, load_config
from services.common.startup_checks import CheckResult
from services.common.transport.model_source import local_model_path, resolve_model

if TYPE_CHECKING:
    from rich.console import Console


# What `rollout.replicas: auto` starts without a GPU: replicas on one CPU share its cores, and the stage-by-stage
# figures (docs/performance.md) found one engine already computing most of the time there.
CPU_AUTO_REPLICAS = 1


@dataclass(frozen=True)
class Gpus:
    """The GPUs a plan is for: how many, and the memory of each (bytes)."""

    count: int
    memory: int


@dataclass(frozen=True)
class Sharing:
    """What the "one GPU shared" placement takes from a run config besides the estimate; the defaults are a bare
    model folder's."""

    reference_replicas: int = 1
    reward_replicas: int = 1
    given: dict[str, float] = field(default_factory=dict)  # service.gpu_memory_fraction
    max_replicas: int = RolloutConfig.model_fields["auto_max_replicas"].default

    def plan(self, est: SizingEstimate, gpu_bytes: int) -> SharedGpu:
        return shared_gpu(est, gpu_bytes, self.reference_replicas, self.given, self.max_replicas, self.reward_replicas)


def sharing_from_config(cfg: RunConfig) -> Sharing:
    return Sharing(
        cfg.reference.replicas,
        cfg.reward.replicas,
        {**cfg.service.gpu_memory_fraction},
        cfg.rollout.auto_max_replicas,
    )


def inputs_from_config(cfg: RunConfig) -> SizingInputs:
    """The sizing inputs of a run config: its algorithm, batch shape, precision and rollout cache."""
    train = cfg.train
    group = cfg.sampling.group_size
    if train.micro_batch_tokens is not None:
        tokens = train.micro_batch_tokens
    else:  # equal-count micro-batches of one optimizer step's rows, each padded to max_seq_len at worst
        rows = max(train.batch_size * group // (train.mini_batches * train.grad_accum_steps), 1)
        tokens = rows * train.max_seq_len
    # rollout.kv_cache_mib is vLLM's; transformers' generate holds the cache its sequences need.
    kv_mib = cfg.rollout.kv_cache_mib if cfg.rollout.backend == "vllm" else None
    lora = cfg.model.lora
    return SizingInputs(
        algorithm=train.algorithm,
        critic=train.critic.kind,
        micro_batch_tokens=tokens,
        max_seq_len=train.max_seq_len,
        group_size=group,
        reference_groups=cfg.reference.batch,
        rollout_sequences=cfg.rollout.prompts_per_batch * group,
        gradient_checkpointing=train.gradient_checkpointing,
        model_dtype=cfg.model.dtype,
        master_dtype="float32" if train.master_weights == "float32" else cfg.model.dtype,
        # A LoRA run trains (and keeps AdamW moments for) its adapters only; `rlpipe plan --lora-rank R` sizes
        # adapters on the default targets for a model folder or a config without model.lora.
        lora_rank=lora.r if lora is not None else None,
        lora_targets=tuple(lora.target_modules) if lora is not None else LORA_DEFAULT_TARGETS,
        kv_cache_bytes=None if kv_mib is None else kv_mib * MIB,
    )


def gpus_at_hand() -> Gpus:
    """The CUDA devices this process sees and the smallest one's memory; none on a CPU-only host."""
    import torch

    if not torch.cuda.is_available():
        return Gpus(0, 0)
    count = torch.cuda.device_count()
    return Gpus(count, min(torch.cuda.get_device_properties(i).total_memory for i in range(count)))


def resolve_gpus(count: int | None, memory_gib: float | None, seen: Callable[[], Gpus]) -> Gpus:
    """The GPUs a plan is for: what the options say, the rest from the GPUs this machine sees (``seen``)."""
    if count is not None and memory_gib is not None:
        return Gpus(count, int(memory_gib * GIB))
    if count == 0:
        return Gpus(0, 0)
    here = seen()
    if memory_gib is not None:
        return Gpus(count or here.count or 1, int(memory_gib * GIB))
    if count is not None and not here.memory:
        raise ValueError(f"--gpus {count} needs --gpu-memory-gib: this machine has no GPU to read the memory from")
    return Gpus(here.count if count is None else count, here.memory)


def host_need(est: SizingEstimate, trainer_ranks: int) -> int:
    """Host memory when every role runs on this machine's CPU: the trainer's ranks, a reference and a rollout."""
    return est.trainer.per_rank(trainer_ranks) * trainer_ranks + est.reference.total + rollout_on_cpu(est)


def sizing_row(cfg: RunConfig, gpus: Gpus, host: HostMemory | None) -> CheckResult:
    """``rlpipe doctor``'s row: on GPUs, the first placement that fits; on the CPU, whether the host swaps."""
    model = local_model_path(cfg)
    if model is None:
        return CheckResult("sizing", "skip", f"{cfg.model.path} is not fetched yet: no config.json to size it by")
    try:
        shape = read_model_shape(model)
        est = estimate(shape, inputs_from_config(cfg))
    except ValueError as error:
        # A config.json this estimate cannot read (the model row judges the folder), or a LoRA target that is no
        # projection of a decoder layer (the trainer, which sees the model's modules, refuses it by name).
        return CheckResult("sizing", "warn", f"no estimate: {error}")
    if gpus.count:
        layouts = placements(est, gpus.count, gpus.memory)
        fitting = [layout for layout in layouts if layout.fits]
        if not fitting:
            return CheckResult(
                "sizing",
                "warn",
                f"no placement fits {gpus.count} GPU(s) of {gib(gpus.memory)} (estimate, +25% headroom): "
                f"{layouts[-1].detail}; see `rlpipe plan`",
            )
        return CheckResult("sizing", "ok", f"{fitting[0].name} fits (estimate, +25% headroom): {fitting[0].detail}")
    need = host_need(est, cfg.trainer.nproc)
    shortfall = memory_shortfall(host, need)
    # Swap already in use elsewhere is worth a note but not a warning: this run may still fit in memory.
    notes = [note for note in (shortfall, swap_in_use(host)) if note]
    detail = f"all roles on this CPU: {gib(with_headroom(need))} (estimate, +25% headroom)"
    return CheckResult("sizing", "warn" if shortfall else "ok", "; ".join([detail, *notes]))


def load_plan_source(source: Path) -> tuple[Path, SizingInputs, Sharing]:
    """A model folder (the defaults of SizingInputs and Sharing) or a run config YAML (its model and inputs)."""
    if source.is_dir():
        return source, SizingInputs(), Sharing()
    cfg = resolve_model(load_config(source))  # a model.path URL: the folder it is fetched to
    return cfg.model.folder, inputs_from_config(cfg), sharing_from_config(cfg)


def with_options(inputs: SizingInputs, **options: object) -> SizingInputs:
    """The inputs with every option the user gave (not None) written over them."""
    return dataclasses.replace(inputs, **{name: value for name, value in options.items() if value is not None})


def render(
    est: SizingEstimate, gpus: Gpus, host: HostMemory | None, console: Console, sharing: Sharing | None = None
) -> None:
    from rich.table import Table

    trainer, reference, rollout = est.trainer, est.reference, est.rollout
    shape = est.shape
    console.print(
        f"model: {shape.parameters / 1e6:.1f}M parameters ({shape.layers} layers, hidden {shape.hidden}, "
        f"{shape.heads} heads / {shape.kv_heads} kv, vocab {shape.vocab}); "
        f"trainable {est.trainable_parameters / 1e6:.1f}M; "
        f"{est.inputs.algorithm}, {est.inputs.micro_batch_tokens} micro-batch tokens, sequences of "
        f"{est.inputs.max_seq_len}, groups of {est.inputs.group_size}"
    )
    table = Table(title="memory per role (estimates; GPU numbers are not measured)")
    for column in ("role", "weights", "gradients", "optimizer", "activations", "logits / KV cache", "total", "+25%"):
        table.add_column(column, no_wrap=True)
    checkpointing = "with" if est.inputs.gradient_checkpointing else "without"
    table.add_row(
        "trainer (1 rank)",
        gib(trainer.weights),
        gib(trainer.gradients),
        gib(trainer.optimizer),
        f"{gib(trainer.activations)} ({checkpointing} checkpointing)",
        gib(trainer.logits),
        gib(trainer.total - trainer.critic),
        gib(with_headroom(trainer.total - trainer.critic)),
    )
    if trainer.critic:
        table.add_row("critic (ppo)", "", "", "", "", "", gib(trainer.critic), gib(with_headroom(trainer.critic)))
    table.add_row(
        "reference", gib(reference.weights), "", "", "", gib(reference.working), gib(reference.total),
        gib(with_headroom(reference.total)),
    )  # fmt: skip
    table.add_row(
        "rollout (vLLM)", gib(rollout.weights), "", "", "", gib(rollout.working), gib(rollout.total),
        gib(with_headroom(rollout.total)),
    )  # fmt: skip
    console.print(table)
    console.print(
        f"trainer activations: {gib(trainer.activations_full)} without gradient checkpointing, "
        f"{gib(trainer.activations_checkpointed)} with it"
    )
    if gpus.count:
        console.print(f"placements on {gpus.count} GPU(s) of {gib(gpus.memory)}:")
        for layout in placements(est, gpus.count, gpus.memory):
            console.print(f"  {_placement_line(layout)}", markup=False, highlight=False)
        shared = (sharing or Sharing()).plan(est, gpus.memory)
        console.print(f"  {shared_gpu_line(shared)}", markup=False, highlight=False)
    else:
        console.print(f"no GPUs given: every role on this CPU needs {gib(with_headroom(host_need(est, 1)))}")
        console.print(f"rollout.replicas: auto starts {CPU_AUTO_REPLICAS} rollout replica on a CPU")
    for warning in plan_warnings(est, gpus, host):
        console.print(f"WARN {warning}", markup=False, highlight=False)


def plan_warnings(est: SizingEstimate, gpus: Gpus, host: HostMemory | None) -> list[str]:
    """Swap in use, and on the CPU a host with less memory than every role together needs."""
    found = (swap_in_use(host), None if gpus.count else memory_shortfall(host, host_need(est, 1)))
    return [warning for warning in found if warning]


def _placement_line(layout: Placement) -> str:
    verdict = "does not fit"
    if layout.fits:
        verdict = f"fits on {layout.gpus_used} GPU(s), trainer world size {layout.trainer_world_size}"
    return f"{layout.name}: {verdict} ({layout.detail})"


def shared_gpu_line(plan: SharedGpu) -> str:
    """The "one GPU shared" line of ``rlpipe plan``: the rollout replicas that fit and each role's share."""
    budgets = ", ".join(
        f"{role} {plan.shares[role]:.3f} = {gib(int(plan.shares[role] * plan.gpu_bytes))}"
        + (" each" if role != "trainer" else "")
        + (" (set)" if role in plan.given else "")
        for role in SHARED_GPU_ROLES
    )
    references = "reference" if plan.reference_replicas == 1 else f"{plan.reference_replicas} references"
    if not plan.fits:
        return (
            f"one GPU shared: does not fit: the trainer and {references} leave no room for one rollout replica "
            f"(shares of the GPU per process: {budgets})"
        )
    return (
        f"one GPU shared: trainer + {references} + {plan.rollout_replicas} rollout replica(s): fits (shares of the "
        f"GPU per process: {budgets}; {plan.fitting} rollout replica(s) fit, rollout.replicas: auto starts "
        f"{plan.rollout_replicas}; {max(1 - plan.claimed, 0):.3f} of the GPU left free)"
    )


def plan_document(
    est: SizingEstimate, gpus: Gpus, host: HostMemory | None, sharing: Sharing | None = None
) -> dict[str, object]:
    """What ``render`` shows, for ``rlpipe plan --json``: sizes in bytes, the headroom and placements spelled out."""
    trainer = est.trainer
    shared = (sharing or Sharing()).plan(est, gpus.memory) if gpus.count else None
    return {
        "estimate": est,
        "totals": {
            "trainer": trainer.total - trainer.critic,
            "critic": trainer.critic,
            "reference": est.reference.total,
            "rollout": est.rollout.total,
        },
        "with_headroom": {
            "trainer": with_headroom(trainer.total - trainer.critic),
            "critic": with_headroom(trainer.critic),
            "reference": with_headroom(est.reference.total),
            "rollout": with_headroom(est.rollout.total),
        },
        "gpus": gpus,
        "placements": placements(est, gpus.count, gpus.memory) if gpus.count else [],
        "shared_gpu": shared,
        "auto_rollout_replicas": shared.rollout_replicas if shared else CPU_AUTO_REPLICAS,
        "host_need": with_headroom(host_need(est, 1)),
        "warnings": [
            w for w in (swap_in_use(host), None if gpus.count else memory_shortfall(host, host_need(est, 1))) if w
        ],
    }


def plan_command(source: Path, gpus: Gpus, console: Console, as_json: bool = False, **options: object) -> int:
    model_path, inputs, sharing = load_plan_source(source)
    inputs = with_options(inputs, **options)
    est, host = estimate(read_model_shape(model_path), inputs), read_host_memory()
    if as_json:
        print_json(plan_document(est, gpus, host, sharing))
    else:
        render(est, gpus, host, console, sharing)
    return 0
