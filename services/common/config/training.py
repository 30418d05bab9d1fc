"""The training sections: the algorithm and its optimizer, KL, clipping, off-policy corrections, the critic and the
trainer's processes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.common import registry
from services.common.config.base import Live, Restart, Section, one_of


class KLConfig(Section):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    estimator: Restart[str] = Field(
        default="k3",
        description="per-token estimator of KL(policy || reference): k1 | abs | k2 | k3 (Schulman 2020, "
        "'Approximating KL Divergence', joschu.net/blog/kl-approx.html; abs = |k1|), or a registered one",
    )
    coef: Live[float] = Field(
        default=0.0, ge=0, description="weight of the KL penalty (per nat of the estimate, per token); 0 = no penalty"
    )
    placement: Restart[Literal["loss", "reward"]] = Field(
        default="loss",
        alias="in",
        description="loss: a term of the loss, as GRPO does (Shao et al. 2024, arXiv:2402.03300); reward: "
        "subtracted from the reward per token, as RLHF's PPO does (Ouyang et al. 2022, arXiv:2203.02155)",
    )

    @field_validator("estimator")
    @classmethod
    def _registered(cls, name: str) -> str:
        return one_of(name, registry.KL_ESTIMATORS.names())


class ClipConfig(Section):
    low: Live[float] = Field(
        default=0.2,
        ge=0,
        lt=1,
        description="the PPO ratio's floor is 1 - low (a fraction; PPO's clipped objective, Schulman et al. 2017, "
        "arXiv:1707.06347)",
    )
    high: Live[float] = Field(
        default=0.2,
        gt=0,
        description="the PPO ratio's ceiling is 1 + high (a fraction); above low is clip-higher (DAPO, Yu et al. 2025, "
        "arXiv:2503.14476)",
    )
    dual: Live[float | None] = Field(
        default=None,
        gt=1,
        description="dual-clip bound c on the ratio for negative advantages (a ratio; Ye et al. 2020, "
        "arXiv:1912.09729); null = off",
    )


class TISConfig(Section):
    level: Restart[Literal["token", "sequence"]] = Field(
        default="token",
        description="token: w_t = min(rho_t, cap); sequence: every token of a response takes min(prod_t rho_t, cap)",
    )
    cap: Restart[float] = Field(
        default=2.0, ge=1, description="largest importance weight (a ratio); larger ones are truncated to it"
    )


class RatioBand(Section):
    """A band [low, high] of the ratio rho = pi_old / pi_rollout; a token or sequence whose ratio leaves it is masked
    out of the loss. It must hold 1: a token the trainer scores as the sampler did is never masked."""

    low: Restart[float] = Field(default=0.5, ge=0, description="smallest ratio kept (a ratio; 0 keeps every low ratio)")
    high: Restart[float] = Field(default=2.0, gt=0, description="largest ratio kept (a ratio)")

    @model_validator(mode="after")
    def _holds_one(self) -> RatioBand:
        if not self.low <= 1.0 <= self.high:
            raise ValueError(
                f"the band [low, high] = [{self.low}, {self.high}] must hold 1, or a token sampled exactly as the "
                "trainer scores it would be masked: set low <= 1 <= high"
            )
        return self


class MaskedISConfig(RatioBand):
    level: Restart[Literal["token", "sequence"]] = Field(
        default="token",
        description="token: w_t = rho_t inside [low, high], else 0; sequence: every token of a response takes "
        "rho_seq = prod_t rho_t inside [low, high], else 0 (the whole response is masked)",
    )


class IcePopConfig(RatioBand):
    low: Restart[float] = Field(
        default=0.5, ge=0, description="alpha: smallest token ratio kept (a ratio; the paper's 0.5)"
    )
    high: Restart[float] = Field(
        default=5.0, gt=0, description="beta: largest token ratio kept (a ratio; the paper's 5.0)"
    )


class GeoMaskConfig(RatioBand):
    low: Restart[float] = Field(
        default=0.999,
        ge=0,
        description="smallest per-token geometric mean ratio exp(mean_t log rho_t) a response may have (a ratio; "
        "verl's default; prime-rl's geo_mask_low is 0.1)",
    )
    high: Restart[float] = Field(
        default=1.001,
        gt=0,
        description="largest geometric mean ratio a response may have (a ratio; verl's default; prime-rl's "
        "geo_mask_high is 10)",
    )
    cap: Restart[float | None] = Field(
        default=None,
        ge=1,
        description="the kept responses' tokens are weighted by min(rho_t, cap), truncated importance sampling "
        "(verl's geo-RS + token-TIS); null: weight 1, a pure rejection (verl's geo-RS)",
    )


class OffPolicyConfig(Section):
    correction: Restart[str] = Field(
        default="none",
        description="how the loss corrects for the gap between the rollout's sampling logprobs and the trainer's "
        "recomputed ones (staleness, in-flight weight updates, inference-engine mismatch), by the per-token ratio "
        "rho_t = pi_old / pi_rollout; each token's loss is multiplied by a weight w_t, 0 masking it out. "
        "none | tis (truncated IS, Yao et al. 2025, 'Your Efficient RL Framework Secretly Brings You Off-Policy RL "
        "Training') | masked_is (masked IS: rho inside a band, 0 outside; Liu, Li et al. 2025, 'When Speed Kills "
        "Stability') | icepop (token-level masked IS with the band of Ling Team 2025, arXiv:2510.18855) | "
        "seq_geo_mask (responses whose geometric mean ratio leaves a band are masked whole), or a registered one. "
        "Each reads its own section below; all but none need old_logprobs: recompute",
    )
    tis: TISConfig = Field(default=TISConfig(), description="truncated importance sampling (correction: tis)")
    masked_is: MaskedISConfig = Field(
        default=MaskedISConfig(), description="masked importance sampling (correction: masked_is)"
    )
    icepop: IcePopConfig = Field(
        default=IcePopConfig(), description="IcePop's token band [alpha, beta] (correction: icepop)"
    )
    seq_geo_mask: GeoMaskConfig = Field(
        default=GeoMaskConfig(), description="the geometric-mean sequence mask (correction: seq_geo_mask)"
    )

    @field_validator("correction")
    @classmethod
    def _registered(cls, name: str) -> str:
        return one_of(name, ["none", *registry.OFF_POLICY_CORRECTIONS.names()])


class CriticConfig(Section):
    kind: Restart[Literal["separate", "head"]] = Field(
        default="separate", description="its own model, or a value head on the policy backbone"
    )
    learning_rate: Restart[float] = Field(
        default=1e-4, gt=0, description="the critic's AdamW learning rate (per optimizer step)"
    )
    value_clip: Restart[float] = Field(
        default=0.2,
        gt=0,
        description="how far a new value estimate may move from the old one in the clipped value loss (in reward "
        "units; PPO's value clipping, Schulman et al. 2017, arXiv:1707.06347)",
    )
    value_coef: Restart[float] = Field(
        default=0.5, gt=0, description="weight of the value loss beside the policy loss (unitless)"
    )
    warmup_steps: Restart[int] = Field(default=0, ge=0, description="steps that train only the critic")


class TrainConfig(Section):
    algorithm: Restart[str] = Field(
        default="grpo",
        description="ppo (Schulman et al. 2017, arXiv:1707.06347) | grpo (Shao et al. 2024, arXiv:2402.03300) | "
        "grpo_no_std (GRPO without the std normalisation) | dr_grpo (Liu et al. 2025, arXiv:2503.20783) | rloo "
        "(Ahmadian et al. 2024, arXiv:2402.14740) | reinforce_pp (Hu 2025, arXiv:2501.03262), or a registered group "
        "estimator",
    )
    seed: Restart[int] = Field(
        default=0, description="seeds the prompt order, the trainer's randomness and the rollouts' sampling"
    )
    total_steps: Restart[int] = Field(
        default=100, ge=1, description="trainer steps the run makes before it ends (steps)"
    )
    batch_size: Restart[int] = Field(default=16, ge=1, description="prompt groups per trainer step")
    epochs: Restart[int] = Field(default=1, ge=1, description="passes over each batch")
    mini_batches: Restart[int] = Field(default=1, ge=1, description="optimizer steps per epoch")
    grad_accum_steps: Restart[int] = Field(
        default=1, ge=1, description="micro-batches of equal row counts per optimizer step (1 with micro_batch_tokens)"
    )
    micro_batch_tokens: Restart[int | None] = Field(
        default=None,
        ge=1,
        description="most tokens one forward/backward pass holds, padding included: each optimizer step's rows are "
        "sorted by length and cut into micro-batches of n rows padded to their longest (prompt + response) L with "
        "n * L <= micro_batch_tokens; gradients accumulate with the loss normalised over the whole optimizer step. "
        "At least max_seq_len (one sequence); null: grad_accum_steps equal-count micro-batches",
    )
    master_weights: Restart[Literal["float32", "model_dtype"]] = Field(
        default="float32",
        description="precision of the parameters the optimizer updates and of its AdamW moments. float32: kept in "
        "float32, forward and backward run under autocast to model.dtype, so updates smaller than bfloat16's "
        "resolution (~1/256 of a weight) still land; model_dtype: stored in model.dtype, half the memory for weights, "
        "gradients and optimizer state, at the cost of those small updates",
    )
    gradient_checkpointing: Restart[bool] = Field(
        default=False,
        description="recompute each layer's activations during the backward pass instead of keeping them: "
        "activation memory no longer grows with depth, for about one more forward pass of compute",
    )
    learning_rate: Live[float] = Field(
        default=1e-4,
        gt=0,
        description="the policy's AdamW learning rate (per optimizer step; Loshchilov & Hutter 2019, arXiv:1711.05101)",
    )
    warmup_steps: Restart[int] = Field(
        default=0, ge=0, description="linear learning-rate warm-up, then constant (steps)"
    )
    weight_decay: Restart[float] = Field(
        default=0.0, ge=0, description="AdamW's decoupled weight decay (per unit of learning rate, per optimizer step)"
    )
    adam_eps: Restart[float] = Field(
        default=1e-8,
        gt=0,
        description="AdamW's epsilon: an update is lr * m / (sqrt(v) + adam_eps), so entries whose gradient is far "
        "below it move by less than the learning rate (larger values damp updates driven by rounding noise)",
    )
    max_grad_norm: Live[float] = Field(
        default=1.0,
        gt=0,
        description="gradients are scaled down to this global L2 norm before each optimizer step (a norm)",
    )
    max_seq_len: Restart[int] = Field(
        default=64, ge=2, description="most tokens of prompt plus completion the trainer takes (tokens)"
    )
    gamma: Restart[float] = Field(
        default=1.0,
        ge=0,
        le=1,
        description="discount per token of PPO's GAE (Schulman et al. 2016, arXiv:1506.02438); a factor",
    )
    lam: Restart[float] = Field(
        default=0.95, ge=0, le=1, description="lambda of PPO's GAE (Schulman et al. 2016, arXiv:1506.02438); a factor"
    )
    kl: KLConfig = Field(default=KLConfig(), description="the KL penalty toward the reference model")
    clip: ClipConfig = Field(default=ClipConfig(), description="the PPO ratio's clipping")
    entropy_coef: Live[float] = Field(
        default=0.0,
        ge=0,
        description="weight of the entropy bonus in the loss (per nat of entropy, per token); 0 = none",
    )
    loss_agg: Restart[str] = Field(
        default="token-mean",
        description="how per-token losses become one: token-mean (every token alike, DAPO, Yu et al. 2025, "
        "arXiv:2503.14476) | seq-mean-token-mean (GRPO's, Shao et al. 2024, arXiv:2402.03300) | seq-mean-token-sum | "
        "seq-mean-token-sum-norm (sums over a constant max_seq_len, Dr. GRPO, Liu et al. 2025, arXiv:2503.20783)",
    )
    old_logprobs: Restart[Literal["rollout", "recompute"]] = Field(
        default="rollout",
        description="pi_old of the PPO ratio: the rollout engine's sampling logprobs (a trust region around the policy "
        "that generated the data, right for asynchronous rollouts) or the trainer's own at the start of the step "
        "(verl's default; pair it with an off_policy.correction for the gap)",
    )
    off_policy: OffPolicyConfig = Field(
        default=OffPolicyConfig(),
        description="off-policy correction toward the rollout's logprobs (docs/algorithms.md). Configs that say "
        "tis: {mode: token | sequence, cap} are read as correction: tis with that level and cap; tis: {mode: off} "
        "as correction: none",
    )
    critic: CriticConfig = Field(default=CriticConfig(), description="the value model of ppo")
    max_staleness: Live[int | None] = Field(
        default=8,
        ge=0,
        description="drop groups generated more than this many versions ago; null disables the bound "
        "(rollouts that cannot pull new weights keep sampling, so in-flight batches alone do not bound it)",
    )
    lost_after_s: Restart[float] = Field(
        default=900.0,
        gt=0,
        description="a fed group neither applied, dropped nor dead-lettered this long after it was fed, while "
        "the trainer has read all of EXPERIENCE, is recorded as lost and its in-flight slot freed",
    )
    dynamic_sampling: Restart[bool] = Field(
        default=False,
        description="DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): a group whose rewards are all equal "
        "(no signal for a group baseline) is filtered out before the step and the batch filled from the stream "
        "instead; filtered groups are settled, never retried, and their share is dynamic_sampling/dropped_fraction",
    )
    max_inflight_batches: Restart[int] = Field(default=2, ge=1, description="prompt batches fed ahead of training")
    synchronous: Restart[bool] = Field(
        default=False,
        description="the synchronous baseline: feed one batch, wait for all of it, step, publish the weights, and "
        "only then feed the next, which the rollouts generate with those weights (every group is generated by "
        "the policy it trains: staleness 0, max_inflight_batches unused). Measures what the asynchronous "
        "pipeline gains (docs/performance.md); slower by design",
    )
    deterministic: Restart[bool] = Field(
        default=False,
        description="reproducible runs (docs/algorithms.md, 'Reproducible runs'): two runs of the same config on the "
        "same machine write the same metrics rows, clock, timing, memory and health readings aside, and end with the "
        "same weights bit for bit. Each sample is drawn with its own seed, from train.seed, its group's id, its "
        "index in the group and the turn; each batch is ordered by feeding order; the trainer, the reference and a "
        "reward model run torch's deterministic algorithms and never score two groups in one forward pass. Needs "
        "train.synchronous, one replica of every role and trainer.nproc 1; costs speed (docs/performance.md; the "
        "hf rollout generates each seeded sample alone). Changed between restarts, the run is reproducible only "
        "from its last start",
    )
    log_interval: Live[int] = Field(
        default=1, ge=1, description="the trainer logs a progress line every this many steps (steps)"
    )
    stall_bound_s: Restart[float] = Field(
        default=1800.0,
        ge=60,
        description="longest the trainer's loop may go without progress before its gRPC health (weight sync and "
        "admin ports) reports NOT_SERVING, so a liveness probe restarts it. The loop beats about every second "
        "while it waits for groups or is paused; one learner step, one evaluation or the final checkpoint upload "
        "beats nothing while it runs, so this must exceed the longest of them (raise it for big models). "
        "At least 60 s: a broker reconnect must not fail the probe",
    )

    @model_validator(mode="before")
    @classmethod
    def _tis_section_of_earlier_configs(cls, data: Any) -> Any:
        # Before off_policy, TIS had a section of its own: `tis: {mode: off | token | sequence, cap}`.
        if not isinstance(data, dict) or "tis" not in data:
            return data
        data = dict(data)
        legacy = data.pop("tis")
        legacy = legacy.model_dump() if isinstance(legacy, BaseModel) else dict(legacy or {})
        mode = legacy.pop("mode", "off")
        if mode in ("off", False, None):  # YAML 1.1 reads a bare `off` as false
            return data
        off_policy = data.get("off_policy", {})
        off_policy = off_policy.model_dump() if isinstance(off_policy, BaseModel) else dict(off_policy)
        if off_policy.get("correction", "none") not in ("none", "tis"):
            raise ValueError(
                f"tis (mode {mode!r}) and off_policy.correction ({off_policy['correction']!r}) both choose a "
                "correction: keep off_policy alone"
            )
        data["off_policy"] = off_policy | {"correction": "tis", "tis": {"level": mode, **legacy}}
        return data

    @model_validator(mode="after")
    def _corrections_need_recomputed_logprobs(self) -> TrainConfig:
        if self.off_policy.correction != "none" and self.old_logprobs != "recompute":
            raise ValueError(
                f"off_policy.correction {self.off_policy.correction!r} corrects the trainer's recomputed logprobs "
                "toward the rollout's (rho = pi_old / pi_rollout, which is 1 with old_logprobs: rollout): set "
                "old_logprobs: recompute, or off_policy.correction: none"
            )
        return self

    @model_validator(mode="after")
    def _deterministic_runs_feed_synchronously(self) -> TrainConfig:
        # Asynchronous feeding lets which groups form a step, and with which policy version they were generated,
        # depend on which replica or group finished first.
        if self.deterministic and not self.synchronous:
            raise ValueError(
                "train.deterministic needs train.synchronous: true (one batch fed, generated by the policy it trains, "
                "and trained on before the next is fed); with asynchronous feeding (train.max_inflight_batches "
                f"{self.max_inflight_batches}) which groups a step trains on depends on which arrive first"
            )
        return self

    @model_validator(mode="after")
    def _micro_batches_hold_a_sequence(self) -> TrainConfig:
        if self.micro_batch_tokens is None:
            return self
        if self.micro_batch_tokens < self.max_seq_len:
            raise ValueError(
                f"micro_batch_tokens ({self.micro_batch_tokens}) is smaller than one sequence of max_seq_len "
                f"({self.max_seq_len}) tokens: set it to at least {self.max_seq_len}, or null"
            )
        if self.grad_accum_steps != 1:
            raise ValueError(
                "micro_batch_tokens and grad_accum_steps both split the optimizer step: set grad_accum_steps: 1 "
                "with micro_batch_tokens, or micro_batch_tokens: null"
            )
        return self

    @field_validator("loss_agg")
    @classmethod
    def _registered(cls, name: str) -> str:
        return one_of(name, registry.AGGREGATIONS.names())

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, name: str) -> str:
        return one_of(name, registry.algorithm_names())


class TrainerConfig(Section):
    nproc: Restart[int] = Field(
        default=1,
        ge=1,
        description="trainer processes on this machine, one per device: above 1, `rlpipe run` starts the trainer "
        "under torchrun and FSDP2 shards the policy (and critic) across them (on the CPU: processes on gloo); at "
        "most the GPUs this machine has when the model runs on CUDA. Restart-only",
    )
    lease_ttl_s: Restart[float] = Field(
        default=15.0,
        gt=0,
        description="seconds the trainer's lease on its run lasts unrenewed (renewed every third of it): a second "
        "trainer of the run is refused while it holds; a restarted one takes over at most this long after its "
        "killed predecessor stopped renewing; a holder paused past it writes nothing more. Restart-only",
    )
    takeover_from: Restart[str] = Field(
        default="",
        description="the lease holder (host:pid) of this run's previous trainer, known dead: its lease is taken at "
        "once instead of after lease_ttl_s. `rlpipe run` sets it when it restarts a trainer it has waited on; "
        "set it by hand only for a trainer you know has exited",
    )
