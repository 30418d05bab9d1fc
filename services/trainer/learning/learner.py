"""The policy (and PPO's critic) with their optimizer, and one trainer step over a batch of groups.

A step follows the usual recipe (verl, OpenRLHF, TRL):
1. score the batch without gradients: ``old_logp`` (the rollout engine's sampling logprobs,
   or the current policy's own with ``old_logprobs: recompute``), the critic's values, the
   per-token rewards (the scalar reward on the last token, minus the KL penalty when it is
   folded into the reward);
2. advantages by the configured algorithm;
3. ``epochs`` passes of ``mini_batches`` optimizer steps each, with gradient accumulation,
   clipped surrogate loss (with the off-policy correction's weights against the rollout engine's
   logprobs, ``corrections.py``), entropy bonus, KL loss term and clipped value loss.

The advantages, each micro-batch's loss and the batch's metrics are ``objective.py``'s functions of the batch and
the config; what a checkpoint must hold to load is ``checkpoint_state.LearnerLayout``'s. This class holds the
model and optimizer, runs the forward passes and applies the updates.

Non-finite numbers never reach the weights: an update whose loss or gradient norm is NaN or infinite is not
applied, nor is any later update of its step, and targets that are not finite (a NaN advantage) skip every update
of the step. ``skipped`` says why; the step's metrics then carry ``loss`` NaN (which the ``nan_loss`` alert rule
judges) and ``updates_skipped``.

Micro-batches (planned in services/trainer/learning/passes.py): an optimizer step's rows are split into
``grad_accum_steps`` equal-count chunks, or by the ``micro_batch_tokens`` budget; each pads only to its own
longest sequence. Each micro-batch's loss is weighted by its share of the step's tokens or
sequences (``micro_batch_weight``), so the accumulated gradient is the unsplit step's.

Device and precision (``Precision``): the policy and critic live on ``model.device``; with
``train.master_weights: float32`` their parameters and AdamW state stay float32 and every
forward runs under autocast to ``model.dtype``.

Across processes (``services/trainer/learning/distributed.py``, under torchrun): the policy and critic are
sharded with FSDP2; every method that runs a collective is a command rank 0 sends first, so the
other ranks, in ``follow``, run the same method with what it sent. Each rank scores and trains on
its share of every optimizer step's rows (``passes.rank_passes``), weighted against the whole step, and the
gradients add up to one process's. Without torchrun (``Mesh()``) nothing of that runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from services.common.config import RunConfig
from services.common.model.evaluation import greedy_accuracy
from services.common.model.lora import adapter_tensors, attach_adapters, base_identity_in_background
from services.common.model.modeling import (
    Precision,
    ResponseBatch,
    enable_gradient_checkpointing,
    host_copy,
    load_model,
    load_tokenizer,
    make_deterministic,
    pack,
    response_window,
    token_logprobs,
    window_logits,
)
from services.common.model.padding import pad_token_id
from services.common.observe import metrics as m
from services.common.observe.flops import device_peak_flops, model_arithmetic, model_flops_utilization
from services.common.transport.messages import ExperienceGroup
from services.common.transport.weightsync.snapshot import HostStaging, Snapshot
from services.trainer.checkpointing.state import (
    Checkpoint,
    LearnerLayout,
    ModuleLayout,
    detached_copy,
    restore_rng,
    rng_state,
    untied,
    widened,
)
from services.trainer.episode_eval import EpisodeEvaluation, evaluate_episodes
from services.trainer.learning import objective
from services.trainer.learning.algorithms import micro_batch_weight
from services.trainer.learning.batch import (
    Batch,
    StepTargets,
    chunks_of,
    non_finite_targets,
    non_finite_update,
)
from services.trainer.learning.corrections import correction_weights, log_ratio
from services.trainer.learning.critic import Critic
from services.trainer.learning.distributed import Mesh, Op
from services.trainer.learning.follower import config_payload, evaluate_payload, step_payload
from services.trainer.learning.passes import rank_passes

if TYPE_CHECKING:
    from peft import PeftModel


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face model (its ``_no_split_modules``): FSDP's units, gathered one at a
    time."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def _number(value: torch.Tensor) -> float:
    """A scalar that may be a DTensor (a norm over sharded gradients) as a float, the same on every rank."""
    return float(value.full_tensor() if isinstance(value, DTensor) else value)


@dataclass
class LearnerState:
    """What a checkpoint takes from the learner besides schedule and RNG, in host memory and one process's format
    whatever the world size: full tensors by name (tied ones once) and AdamW's ``state_dict``."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None  # None: not asked for (a save without optimizer state)
    critic: dict[str, torch.Tensor] | None


class Learner:
    """The policy, PPO's critic and their optimizer; ``step`` trains on one batch of groups.

    Attributes: ``mesh`` (this process among the trainer's; ``Mesh()`` alone), ``precision`` (device and
    dtypes), ``device``, ``model`` (the policy), ``tokenizer``, ``critic`` (None unless PPO), ``optimizer``
    (AdamW; the critic in its own group), ``scheduler``, ``generator`` (mini-batch order, checkpointed; the same
    on every rank), ``steps_done``, ``staging`` (the host memory published versions are copied into).

    With a distributed ``mesh`` every rank constructs one (it joins the process group and takes rank 0's
    config); rank 0 then calls the methods below and the others run ``follower.follow``.
    """

    def __init__(self, cfg: RunConfig, mesh: Mesh | None = None):
        self.mesh = mesh or Mesh()
        device = self.mesh.start(Precision.of(cfg.model, cfg.train.master_weights).device)
        cfg = self.mesh.agree(cfg)
        self.cfg = cfg
        train = cfg.train
        if train.deterministic:  # before anything draws from torch's generator: adapters and a value head do
            make_deterministic(train.seed)
        self.precision = replace(Precision.of(cfg.model, train.master_weights), device=device)
        self.device = self.precision.device
        # model.path's content hash, read beside the load: a checkpoint records it, and a resume over other weights
        # is refused (LearnerLayout.check).
        base_hash = base_identity_in_background(cfg.model.folder)
        # transformers wraps PreTrainedModel.to in functools.wraps(Module.to), which loses the bound self's type.
        model = load_model(cfg.model.folder, self.precision.param_dtype).to(self.device)  # pyright: ignore[reportArgumentType]
        self.model: PreTrainedModel | PeftModel = model
        # perf/mfu (services/common/observe/flops.py): the model's arithmetic, and the device's bfloat16 peak
        # where the table knows it and the step computes in bfloat16.
        self.arithmetic = model_arithmetic(self.model.config, sum(p.numel() for p in self.model.parameters()))
        on_bf16_gpu = self.device.type == "cuda" and self.precision.compute_dtype == torch.bfloat16
        self.peak_flops = device_peak_flops(torch.cuda.get_device_name(self.device)) if on_bf16_gpu else None
        if train.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        # With LoRA only the adapters train: the names a checkpoint, the optimizer and weight sync hold (None: all).
        self.adapter_names: set[str] | None = None
        self.base_model: tuple[str, str] = base_hash()  # path and content hash of the model the run started from
        if cfg.model.lora is not None:
            self.model = attach_adapters(model, cfg.model.lora, cfg.model.folder)
            self.adapter_names = {name for name, p in self.model.named_parameters() if p.requires_grad}
        self.tokenizer = load_tokenizer(cfg.model.folder)
        self.pad_id = pad_token_id(self.tokenizer)
        # The policy's transformers model (inside peft's wrappers with LoRA): its config and dtype size the critic.
        self.critic = Critic(cfg, model).to(self.device) if train.algorithm == "ppo" else None
        # What a checkpoint must hold to load, in whole tensors: taken before sharding splits them.
        model_layout = ModuleLayout.of(self.model, self.adapter_names)
        critic_layout = ModuleLayout.of(self.critic) if self.critic is not None else None
        parameter_shapes = [tuple(p.shape) for p in self.model.parameters() if p.requires_grad]
        parameter_shapes += [tuple(p.shape) for p in self.critic.parameters()] if self.critic is not None else []
        # Sharding replaces the parameters with DTensors: before the optimizer takes them.
        # With LoRA the root is the transformers model inside peft's wrappers: generation calls it past them.
        # (peft wraps it in place: the PeftModel's get_base_model() is this same model).
        root = model
        self.mesh.shard(root, _layers(root))
        if self.critic is not None:
            backbone = getattr(self.critic, "backbone", None)
            units = _layers(backbone) if backbone is not None else []
            self.mesh.shard(self.critic, units, forward_methods=("values",))
        # Frozen base weights get no optimizer state: with LoRA, AdamW's moments exist for the adapters alone.
        groups = [{"params": [p for p in self.model.parameters() if p.requires_grad], "lr": train.learning_rate}]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters()), "lr": train.critic.learning_rate})
        self.optimizer = torch.optim.AdamW(groups, weight_decay=train.weight_decay, eps=train.adam_eps)
        self.layout = LearnerLayout(
            base_model=self.base_model,
            adapters=self.adapter_names is not None,
            model_path=str(cfg.model.path),
            algorithm=train.algorithm,
            model=model_layout,
            critic=critic_layout,
            optimizer_groups=tuple(len(group["params"]) for group in groups),
            parameter_shapes=tuple(parameter_shapes),
        )
        warmup = train.warmup_steps
        # Adam's first updates are full-size whatever the gradient; warm-up keeps them from jolting the policy.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1))
        )
        self.generator = torch.Generator().manual_seed(train.seed)
        self.steps_done = 0
        self.skipped: str | None = None  # why the last step applied none or only part of its updates
        self.staging = HostStaging()  # the host memory each published version is copied into

    def reconfigure(self, cfg: RunConfig) -> None:
        """Take a live config change. Hyperparameters are read at every step; the learning rate also lives
        in the scheduler."""
        with self.mesh.command(Op.RECONFIGURE, config_payload(cfg) if self.mesh.leads else b""):
            self.cfg = cfg
            self.scheduler.base_lrs[0] = cfg.train.learning_rate
            self.optimizer.param_groups[0]["lr"] = cfg.train.learning_rate * self.scheduler.lr_lambdas[0](
                self.scheduler.last_epoch
            )

    def rng_state(self) -> dict[str, Any]:
        return {**rng_state(), "minibatch_order": self.generator.get_state()}

    # --- full state: weight sync, checkpoints, evaluation ------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """What a policy version is, in host memory: the full state dict (tied names share a tensor), or with LoRA
        the adapters under peft's saved names; ``{}`` on ranks but 0."""
        with self.mesh.command(Op.WEIGHTS):
            state = self.mesh.gather_module(self.model, self.adapter_names)
        return state if self.adapter_names is None else adapter_tensors(state)

    def snapshot(self, version: int, step: int) -> Snapshot:
        """The policy's weights as weight sync serves them, as ``version`` made at ``step``: with LoRA only the
        adapters, which the rollout loads over the base it holds.

        In one process they are copied into ``staging``'s reused host memory (from a GPU, queued on a copy stream
        that the next step's kernels wait for: see ``HostStaging``); across processes they are gathered."""
        if self.mesh.distributed:
            return Snapshot(version=version, step=step, tensors=tuple(self.weights().items()))
        state = self.model.state_dict()
        if self.adapter_names is not None:
            state = adapter_tensors({name: t for name, t in state.items() if name in self.adapter_names})
        return self.staging.copy(state.items(), version, step)

    def state(self, optimizer: bool = True) -> LearnerState:
        """A host-memory copy of weights, critic and (with ``optimizer``) optimizer state that training cannot
        change (rank 0's is complete; the others' empty)."""
        if not self.mesh.distributed:
            return LearnerState(
                model=detached_copy(self.model, self.adapter_names),
                optimizer=host_copy(self.optimizer.state_dict()) if optimizer else None,
                critic=detached_copy(self.critic) if self.critic is not None else None,
            )
        with self.mesh.command(Op.STATE):  # every rank gathers alike: the followers do not know what is kept
            model = untied(self.mesh.gather_module(self.model, self.adapter_names))
            critic = untied(self.mesh.gather_module(self.critic)) if self.critic is not None else None
            gathered = self.mesh.gather_optimizer(self.optimizer)
        return LearnerState(model=model, optimizer=gathered if optimizer else None, critic=critic)

    def evaluate(self, rows: list[dict[str, Any]], max_new_tokens: int) -> float:
        """Greedy accuracy on held-out ``rows``; every rank generates alike (each forward gathers the shards)."""
        with self.mesh.command(Op.EVALUATE, evaluate_payload(rows, max_new_tokens) if self.mesh.leads else b""):
            return greedy_accuracy(
                self.model, self.tokenizer, rows, max_new_tokens, self.precision, self.cfg.data.eval_batch_size
            )

    def evaluate_episodes(self, rows: list[dict[str, Any]]) -> EpisodeEvaluation:
        """Greedy held-out episodes of ``rows`` with the run's environment (a multi-turn run's evaluation)."""
        payload = evaluate_payload(rows, 0, episodes=True) if self.mesh.leads else b""
        with self.mesh.command(Op.EVALUATE, payload):
            return evaluate_episodes(self.model, self.tokenizer, rows, self.cfg, precision=self.precision)

    def check(self, ckpt: Checkpoint) -> None:
        """Raise CheckpointMismatch unless ``ckpt`` loads whole (``LearnerLayout.check``). Changes nothing, so a
        caller checks first and then switches (``load``), and a checkpoint that does not fit leaves the model as it
        was."""
        self.layout.check(ckpt)

    def load(self, ckpt: Checkpoint | None) -> None:
        """Everything a checkpoint holds about learning: weights, critic, optimizer, schedule, RNG streams.

        Rank 0 checks the checkpoint whole first (``check``): one that does not fit raises before anything changes.
        Across processes rank 0 passes the checkpoint it read and the others None: each keeps its shards."""
        if ckpt is not None:
            ckpt = widened(ckpt, self.layout.model)
            self.check(ckpt)
        if self.mesh.distributed:
            self._load_sharded(ckpt)
            return
        assert ckpt is not None
        # Checked whole above: only the aliases of tied tensors are absent, and they share the storage loaded.
        self.model.load_state_dict(ckpt.model, strict=False)
        if self.critic is not None and ckpt.critic is not None:
            self.critic.load_state_dict(ckpt.critic, strict=False)
        if ckpt.optimizer is not None:
            self.optimizer.load_state_dict(ckpt.optimizer)
        else:
            self.optimizer.state.clear()  # saved without it (checkpoint.optimizer_every): AdamW's moments start at 0
        self.scheduler.load_state_dict(ckpt.scheduler)
        restore_rng(ckpt.rng)
        self.generator.set_state(ckpt.rng["minibatch_order"])
        self.steps_done = ckpt.step

    def _load_sharded(self, ckpt: Checkpoint | None) -> None:
        with self.mesh.command(Op.LOAD):
            small = self.mesh.share(
                {
                    "step": ckpt.step,
                    "scheduler": ckpt.scheduler,
                    "rng": ckpt.rng,
                    "critic": ckpt.critic is not None,
                    "optimizer": ckpt.optimizer is not None,
                }
                if ckpt is not None
                else None
            )
            self.mesh.load_module(self.model, ckpt.model if ckpt is not None else None, self.adapter_names)
            if self.critic is not None and small["critic"]:
                self.mesh.load_module(self.critic, ckpt.critic if ckpt is not None else None)
            if small["optimizer"]:
                self.mesh.load_optimizer(self.optimizer, ckpt.optimizer if ckpt is not None else None)
            else:
                self.optimizer.state.clear()
        self.scheduler.load_state_dict(small["scheduler"])
        restore_rng(small["rng"])
        self.generator.set_state(small["rng"]["minibatch_order"])
        self.steps_done = small["step"]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # --- forward passes ---------------------------------------------------------------------

    def _pack(self, rows: torch.Tensor, batch: Batch) -> ResponseBatch:
        # Padded to these rows' own longest sequence: a length-sorted micro-batch of short rows stays short.
        return pack([batch.pairs[i] for i in rows.tolist()], self.pad_id).to(self.device)

    def _forward(self, rows: torch.Tensor, batch: Batch) -> tuple[ResponseBatch, torch.Tensor, torch.Tensor | None]:
        """Policy logits ``[n, R, V]`` and critic values ``[n, R]`` (None without a critic) for ``rows``."""
        packed = self._pack(rows, batch)
        want_hidden = self.critic is not None and self.critic.kind == "head"
        with self.precision.autocast():
            output = self.model(
                input_ids=packed.input_ids,
                attention_mask=packed.attention_mask,
                output_hidden_states=want_hidden,
                use_cache=False,  # no generation here; a KV cache is only memory
                logits_to_keep=response_window(packed),
            )
            values = self.critic.values(packed, output) if self.critic is not None else None
        logits = window_logits(output.logits, packed)
        return packed, logits, values

    @torch.no_grad()
    def _score(self, batch: Batch, policy: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Before any update: the current policy's logprobs (if ``policy``) and the critic's values for the
        whole batch."""
        old_logp = torch.zeros_like(batch.mask) if policy else None
        old_values = torch.zeros_like(batch.mask) if self.critic is not None else None
        # A separate critic needs no policy pass when the rollout's logprobs serve as pi_old.
        critic = self.critic
        values_only = critic if not policy and critic is not None and critic.kind == "separate" else None
        for rows, counts in rank_passes(torch.arange(len(batch.pairs)), batch.lengths, self.cfg.train, self.mesh):
            if values_only is not None:
                packed = self._pack(rows, batch)
                with self.precision.autocast():
                    logits, values = None, values_only.values(packed, None)
            else:
                packed, logits, values = self._forward(rows, batch)
            if not counts:
                continue
            r = packed.mask.shape[1]
            at = rows.to(self.device)
            if old_logp is not None and logits is not None:  # logits come with every pass that scores the policy
                old_logp[at, :r] = token_logprobs(logits, packed.targets) * batch.mask[at, :r]
            if old_values is not None and values is not None:
                old_values[at, :r] = values * batch.mask[at, :r]
        # Each rank filled its own rows and left the others' zero: the sum is every row.
        if old_logp is not None:
            self.mesh.sum_(old_logp)
        if old_values is not None:
            self.mesh.sum_(old_values)
        return old_logp, old_values

    # --- the step ---------------------------------------------------------------------------

    def step(self, groups: list[ExperienceGroup], policy_version: int) -> dict[str, float]:
        """One trainer step on ``groups``; returns the step's metrics."""
        with self.mesh.command(Op.STEP, step_payload(groups, policy_version) if self.mesh.leads else b""):
            return self._step(groups, policy_version)

    def _step(self, groups: list[ExperienceGroup], policy_version: int) -> dict[str, float]:
        started = time.perf_counter()
        train = self.cfg.train
        batch = Batch.of(groups).to(self.device)
        targets = self.targets(batch)
        critic_only = self.critic is not None and self.steps_done < train.critic.warmup_steps

        self.model.train()
        sums: dict[str, float] = {}
        attempted = applied = 0
        grad_norms = []
        # Non-finite targets (a NaN advantage) would make every update that touches their rows NaN: none is applied.
        self.skipped = non_finite_targets(targets, batch.mask)
        planned = train.epochs * len(chunks_of(torch.arange(len(batch.pairs)), train.mini_batches))
        for _ in range(train.epochs):
            order = torch.randperm(len(batch.pairs), generator=self.generator)
            for mini in chunks_of(order, train.mini_batches):
                stats = self.accumulate(batch, mini, targets, critic_only)
                for name, value in stats.items():
                    sums[name] = sums.get(name, 0.0) + value
                attempted += 1
                grad_norms.append(_number(torch.nn.utils.clip_grad_norm_(self.parameters(), train.max_grad_norm)))
                # Summed over the ranks, so every rank takes the same decision.
                loss = self.mesh.sum_values({"loss": stats["loss"]})["loss"]
                self.skipped = self.skipped or non_finite_update(loss, grad_norms[-1])
                if self.skipped:
                    # AdamW would write NaN into every weight and its moments: this update and the rest of the
                    # step's are dropped, and the weights stay those of the last finite update.
                    self.optimizer.zero_grad(set_to_none=True)
                    break
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                applied += 1
            if self.skipped:
                break
        learning_rate = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.steps_done += 1
        sums = self.mesh.sum_values(sums)  # each rank's share of the loss statistics
        metrics = {name: value / attempted for name, value in sums.items()}
        if self.skipped:
            # The step's loss is not a number whichever part was not: the nan_loss rule sees every skip.
            metrics["loss"] = math.nan
        metrics["updates_skipped"] = float(planned - applied)
        metrics |= objective.batch_metrics(batch, targets, policy_version)
        elapsed = time.perf_counter() - started
        metrics |= {
            "grad_norm": float(np.mean(grad_norms)),
            "learning_rate": learning_rate,
            "critic_only": float(critic_only),
            "step_time_s": elapsed,
            "tokens_per_s": float(batch.filled.sum()) * train.epochs / max(elapsed, 1e-9),
        }
        if self.peak_flops is not None:  # every rank's rows are in the batch: its FLOPs over all ranks' time
            flops = self.arithmetic.step_flops(batch.lengths.tolist(), train.epochs)
            metrics[m.MFU.key] = model_flops_utilization(flops, elapsed, self.peak_flops, self.mesh.world)
        return metrics

    def targets(self, batch: Batch) -> StepTargets:
        """pi_old, advantages and (PPO) value targets, from the policy and critic before this step's first update."""
        train = self.cfg.train
        self.model.eval()  # scoring must match generation: no dropout
        recompute = train.old_logprobs == "recompute"
        scored_logp, old_values = (
            self._score(batch, policy=recompute) if recompute or self.critic is not None else (None, None)
        )
        old_logp = scored_logp if scored_logp is not None else batch.rollout_logp  # scored when recompute
        advantages, returns = objective.advantages(train, batch, old_logp, old_values)
        # rho = pi_old / pi_rollout is 1 by definition when the rollout's logprobs are pi_old: nothing to measure.
        log_rho = log_ratio(old_logp, batch.rollout_logp, batch.mask) if recompute else None
        weights = correction_weights(log_rho, batch.mask, train.off_policy) if log_rho is not None else None
        return StepTargets(old_logp, advantages, old_values, returns, log_rho, weights)

    def accumulate(
        self, batch: Batch, rows: torch.Tensor, targets: StepTargets, critic_only: bool = False
    ) -> dict[str, float]:
        """Add to each parameter's ``.grad`` the gradient of the loss aggregated over ``rows`` (one optimizer
        step's), micro-batch by micro-batch; returns the loss statistics of those rows, weighted the same way.

        Each micro-batch's loss is weighted by its share of the step's tokens (token-mean) or sequences
        (sequence means), so the sum is the step's aggregate, not a mean of micro-batch means.
        """
        loss_agg = self.cfg.train.loss_agg
        step_mask = batch.mask[rows.to(self.device)]
        stats: dict[str, float] = {}
        for micro, counts in rank_passes(rows, batch.lengths, self.cfg.train, self.mesh):
            weight = micro_batch_weight(batch.mask[micro.to(self.device)], step_mask, loss_agg) if counts else 0.0
            packed, logits, values = self._forward(micro, batch)
            loss, micro_stats = objective.micro_batch_loss(
                self.cfg.train, batch, micro, packed, logits, values, targets, critic_only
            )
            (loss * weight).backward()
            for name, value in micro_stats.items():
                # A pass that does not count still names every statistic: the ranks sum them key by key.
                stats[name] = stats.get(name, 0.0) + (float(value) * weight if counts else 0.0)
        return stats
