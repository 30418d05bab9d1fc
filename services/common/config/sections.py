"""The section models of a run's config and the run config that holds them."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from services.common import registry
from services.common.config.alerts import AlertsConfig
from services.common.config.base import ENV_PREFIX, SECRETS_DIRS, Section, one_of, read_environment


class LoraConfig(Section):
    """LoRA adapters on the policy (peft): only they train, have optimizer state, sync and are checkpointed."""

    r: int = Field(16, gt=0, description="rank of each adapter: the inner dimension of its A and B matrices (> 0)")
    alpha: float = Field(
        32.0, gt=0, description="scale numerator (> 0): an adapter's update B @ A is multiplied by alpha / r"
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="dropout probability on each adapter's input while training (0 to <1)"
    )
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="names of the Linear modules that get an adapter (the last part of a module's path, e.g. "
        "q_proj); each must name one of the model's Linear modules, or the trainer refuses to start listing them",
    )


class ModelConfig(Section):
    path: Path = Field(description="Hugging Face model folder (config.json, weights, tokenizer)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="weights and activations of rollout, reference and evaluation, and the trainer's compute dtype "
        "(its parameters stay float32 by default: train.master_weights). float16 is refused: the trainer has no loss "
        "scaling, so its small gradients would underflow to zero",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where the trainer, critic, reference and evaluation run: auto = CUDA when this process sees a "
        "GPU, else CPU; cuda without a GPU stops the service at start",
    )
    lora: LoraConfig | None = Field(
        None,
        description="train LoRA adapters instead of every weight (None = full weights); the reference and the "
        "rollout keep the base model at path",
    )

    @field_validator("path")
    @classmethod
    def _folder_with_config(cls, path: Path) -> Path:
        if not path.is_dir():
            raise ValueError(f"model folder {str(path)!r} does not exist")
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json")
        return path


class DataColumns(Section):
    """Which of a dataset's columns hold what a row needs (docs/configuration.md, data.columns)."""

    prompt: str = Field("prompt", min_length=1, description="the plain prompt text")
    messages: str = Field(
        "messages", min_length=1, description="a chat ([{role, content}, ...]) rendered with the chat template"
    )
    answer: str = Field("answer", min_length=1, description="the reference answer the reward compares with")
    id: str = Field("id", min_length=1, description="a row's stable id (optional; the row's index otherwise)")


class DataConfig(Section):
    task_name: str = Field(
        "arithmetic",
        description="a label for what the data asks (arithmetic, word-problems, ...): kept with the config and in the "
        "run's records; which rows are read is train_path's, how they are scored reward.functions'",
    )
    train_path: Path = Field(
        description="JSON Lines file, or a local Hugging Face dataset: a save_to_disk folder, a Parquet, Arrow, "
        "JSON or CSV file, or a folder of them"
    )
    eval_path: Path | None = Field(None, description="held-out rows, in any form train_path takes")
    split: str = Field("train", min_length=1, description="the split of train_path to train on, when it holds several")
    eval_split: str = Field(
        "test", min_length=1, description="the split of eval_path to evaluate on, when it holds several"
    )
    columns: DataColumns = Field(DataColumns(), description="which dataset columns hold a row's parts (names)")
    streaming: bool = Field(
        False,
        description="read train_path as a stream instead of all at once, for datasets larger than memory: rows are "
        "checked as they come (a bad one is skipped and logged) and a resume reads up to its place again",
    )
    shuffle_buffer: int = Field(
        10_000, ge=1, description="rows a streamed dataset is shuffled within (a full shuffle needs them all)"
    )
    eval_every_steps: int = Field(10, ge=0, description="0 disables periodic evaluation")
    eval_size: int = Field(
        500, ge=1, description="held-out rows one evaluation scores (rows; the first ones of eval_path)"
    )
    shuffle: bool = Field(
        True, description="visit the training rows in a seeded (train.seed) random order each epoch; false = file order"
    )

    @field_validator("train_path", "eval_path")
    @classmethod
    def _file_exists(cls, path: Path | None) -> Path | None:
        if path is not None and not path.exists():
            raise ValueError(f"data file or folder {str(path)!r} does not exist")
        return path


class SamplingConfig(Section):
    group_size: int = Field(8, ge=1, description="completions per prompt (n)")
    temperature: float = Field(
        1.0,
        gt=0,
        description="softmax temperature of the rollout's sampling (unitless; 1 = the policy's own distribution)",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="nucleus sampling (Holtzman et al. 2020, arXiv:1904.09751): sample from the smallest set of tokens "
        "whose probability sums to top_p (a probability; 1 = every token)",
    )
    max_new_tokens: int = Field(
        8, ge=1, description="most tokens one completion may generate (tokens); longer ones are truncated"
    )


class KLConfig(Section):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    estimator: str = Field(
        "k3",
        description="per-token estimator of KL(policy || reference): k1 | abs | k2 | k3 (Schulman 2020, "
        "'Approximating KL Divergence', joschu.net/blog/kl-approx.html; abs = |k1|), or a registered one",
    )
    coef: float = Field(
        0.0, ge=0, description="weight of the KL penalty (per nat of the estimate, per token); 0 = no penalty"
    )
    placement: Literal["loss", "reward"] = Field(
        "loss",
        alias="in",
        description="loss: a term of the loss, as GRPO does (Shao et al. 2024, arXiv:2402.03300); reward: "
        "subtracted from the reward per token, as RLHF's PPO does (Ouyang et al. 2022, arXiv:2203.02155)",
    )

    @field_validator("estimator")
    @classmethod
    def _registered(cls, name: str) -> str:
        return one_of(name, registry.KL_ESTIMATORS.names())


class ClipConfig(Section):
    low: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="the PPO ratio's floor is 1 - low (a fraction; PPO's clipped objective, Schulman et al. 2017, "
        "arXiv:1707.06347)",
    )
    high: float = Field(
        0.2,
        gt=0,
        description="the PPO ratio's ceiling is 1 + high (a fraction); above low is clip-higher (DAPO, Yu et al. 2025, "
        "arXiv:2503.14476)",
    )
    dual: float | None = Field(
        None,
        gt=1,
        description="dual-clip bound c on the ratio for negative advantages (a ratio; Ye et al. 2020, "
        "arXiv:1912.09729); null = off",
    )


class TISConfig(Section):
    mode: Literal["off", "token", "sequence"] = Field(
        "off",
        description="truncated importance sampling of the recomputed logprobs against the rollout's, per token or per "
        "sequence (Yao et al. 2025, 'Your Efficient RL Framework Secretly Brings You Off-Policy RL Training')",
    )
    cap: float = Field(2.0, ge=1, description="largest importance weight (a ratio); larger ones are truncated to it")

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, mode: object) -> object:
        # YAML 1.1 reads a bare `off` as false.
        return "off" if mode is False else mode


class CriticConfig(Section):
    kind: Literal["separate", "head"] = Field(
        "separate", description="its own model, or a value head on the policy backbone"
    )
    learning_rate: float = Field(1e-4, gt=0, description="the critic's AdamW learning rate (per optimizer step)")
    value_clip: float = Field(
        0.2,
        gt=0,
        description="how far a new value estimate may move from the old one in the clipped value loss (in reward "
        "units; PPO's value clipping, Schulman et al. 2017, arXiv:1707.06347)",
    )
    value_coef: float = Field(0.5, gt=0, description="weight of the value loss beside the policy loss (unitless)")
    warmup_steps: int = Field(0, ge=0, description="steps that train only the critic")


class TrainConfig(Section):
    algorithm: str = Field(
        "grpo",
        description="ppo (Schulman et al. 2017, arXiv:1707.06347) | grpo (Shao et al. 2024, arXiv:2402.03300) | "
        "grpo_no_std (GRPO without the std normalisation) | dr_grpo (Liu et al. 2025, arXiv:2503.20783) | rloo "
        "(Ahmadian et al. 2024, arXiv:2402.14740) | reinforce_pp (Hu 2025, arXiv:2501.03262), or a registered group "
        "estimator",
    )
    seed: int = Field(0, description="seeds the prompt order, the trainer's randomness and the rollouts' sampling")
    total_steps: int = Field(100, ge=1, description="trainer steps the run makes before it ends (steps)")
    batch_size: int = Field(16, ge=1, description="prompt groups per trainer step")
    epochs: int = Field(1, ge=1, description="passes over each batch")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per epoch")
    grad_accum_steps: int = Field(
        1, ge=1, description="micro-batches of equal row counts per optimizer step (1 with micro_batch_tokens)"
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="most tokens one forward/backward pass holds, padding included: each optimizer step's rows are "
        "sorted by length and cut into micro-batches of n rows padded to their longest (prompt + response) L with "
        "n * L <= micro_batch_tokens; gradients accumulate with the loss normalised over the whole optimizer step. "
        "At least max_seq_len (one sequence); null: grad_accum_steps equal-count micro-batches",
    )
    master_weights: Literal["float32", "model_dtype"] = Field(
        "float32",
        description="precision of the parameters the optimizer updates and of its AdamW moments. float32: kept in "
        "float32, forward and backward run under autocast to model.dtype, so updates smaller than bfloat16's "
        "resolution (~1/256 of a weight) still land; model_dtype: stored in model.dtype, half the memory for weights, "
        "gradients and optimizer state, at the cost of those small updates",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute each layer's activations during the backward pass instead of keeping them: "
        "activation memory no longer grows with depth, for about one more forward pass of compute",
    )
    learning_rate: float = Field(
        1e-4,
        gt=0,
        description="the policy's AdamW learning rate (per optimizer step; Loshchilov & Hutter 2019, arXiv:1711.05101)",
    )
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up, then constant (steps)")
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW's decoupled weight decay (per unit of learning rate, per optimizer step)"
    )
    adam_eps: float = Field(
        1e-8,
        gt=0,
        description="AdamW's epsilon: an update is lr * m / (sqrt(v) + adam_eps), so entries whose gradient is far "
        "below it move by less than the learning rate (larger values damp updates driven by rounding noise)",
    )
    max_grad_norm: float = Field(
        1.0, gt=0, description="gradients are scaled down to this global L2 norm before each optimizer step (a norm)"
    )
    max_seq_len: int = Field(64, ge=2, description="most tokens of prompt plus completion the trainer takes (tokens)")
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="discount per token of PPO's GAE (Schulman et al. 2016, arXiv:1506.02438); a factor",
    )
    lam: float = Field(
        0.95, ge=0, le=1, description="lambda of PPO's GAE (Schulman et al. 2016, arXiv:1506.02438); a factor"
    )
    kl: KLConfig = Field(KLConfig(), description="the KL penalty toward the reference model")
    clip: ClipConfig = Field(ClipConfig(), description="the PPO ratio's clipping")
    entropy_coef: float = Field(
        0.0, ge=0, description="weight of the entropy bonus in the loss (per nat of entropy, per token); 0 = none"
    )
    loss_agg: str = Field(
        "token-mean",
        description="how per-token losses become one: token-mean (every token alike, DAPO, Yu et al. 2025, "
        "arXiv:2503.14476) | seq-mean-token-mean (GRPO's, Shao et al. 2024, arXiv:2402.03300) | seq-mean-token-sum | "
        "seq-mean-token-sum-norm (sums over a constant max_seq_len, Dr. GRPO, Liu et al. 2025, arXiv:2503.20783)",
    )
    old_logprobs: Literal["rollout", "recompute"] = Field(
        "rollout",
        description="pi_old of the PPO ratio: the rollout engine's sampling logprobs (a trust region around the policy "
        "that generated the data, right for asynchronous rollouts) or the trainer's own at the start of the step "
        "(verl's default; pair it with tis to correct for the gap)",
    )
    tis: TISConfig = Field(TISConfig(), description="truncated importance sampling against the rollout's logprobs")
    critic: CriticConfig = Field(CriticConfig(), description="the value model of ppo")
    max_staleness: int | None = Field(
        8,
        ge=0,
        description="drop groups generated more than this many versions ago; null disables the bound "
        "(rollouts that cannot pull new weights keep sampling, so in-flight batches alone do not bound it)",
    )
    lost_after_s: float = Field(
        900.0,
        gt=0,
        description="a fed group neither applied, dropped nor dead-lettered this long after it was fed, while "
        "the trainer has read all of EXPERIENCE, is recorded as lost and its in-flight slot freed",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): a group whose rewards are all equal "
        "(no signal for a group baseline) is filtered out before the step and the batch filled from the stream "
        "instead; filtered groups are settled, never retried, and their share is dynamic_sampling/dropped_fraction",
    )
    max_inflight_batches: int = Field(2, ge=1, description="prompt batches fed ahead of training")
    synchronous: bool = Field(
        False,
        description="the synchronous baseline: feed one batch, wait for all of it, step, publish the weights, and "
        "only then feed the next, which the rollouts generate with those weights (every group is generated by "
        "the policy it trains: staleness 0, max_inflight_batches unused). Measures what the asynchronous "
        "pipeline gains (docs/performance.md); slower by design",
    )
    log_interval: int = Field(1, ge=1, description="the trainer logs a progress line every this many steps (steps)")
    stall_bound_s: float = Field(
        1800.0,
        ge=60,
        description="longest the trainer's loop may go without progress before its gRPC health (weight sync and "
        "admin ports) reports NOT_SERVING, so a liveness probe restarts it. The loop beats about every second "
        "while it waits for groups or is paused; one learner step, one evaluation or the final checkpoint upload "
        "beats nothing while it runs, so this must exceed the longest of them (raise it for big models). "
        "At least 60 s: a broker reconnect must not fail the probe",
    )

    @model_validator(mode="after")
    def _tis_needs_recomputed_logprobs(self) -> TrainConfig:
        if self.tis.mode != "off" and self.old_logprobs != "recompute":
            raise ValueError(
                "tis corrects recomputed logprobs toward the rollout's: set old_logprobs: recompute or tis.mode: off"
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


class CheckpointConfig(Section):
    store_url: str = Field("", description="file:///path or s3://bucket/prefix; empty = file://<runs_dir>")
    save_every_steps: int = Field(25, ge=0, description="0 saves only at the end")
    keep_last: int = Field(
        3, ge=1, description="newest checkpoints kept; older ones are pruned unless marked stable (count)"
    )
    optimizer_every: int = Field(
        1,
        ge=1,
        description="the optimizer state (AdamW's moments, twice the float32 weights' bytes) goes into every K-th "
        "periodic save (count of saves, by step: step / save_every_steps divisible by K); the others hold weights, "
        "schedule and RNG only, and a resume or rollback to one starts the optimizer fresh (event optimizer_fresh). "
        "Saves at a stop, at the end of a run and on request always hold it",
    )
    weights_dtype: Literal["master", "serving"] = Field(
        "master",
        description="dtype of the saved weights: master = the trainer's own (float32 master weights: a resume is "
        "exact); serving = model.dtype (half the bytes when it is bfloat16; a resume widens them back to the master "
        "dtype and is not bit-exact)",
    )
    resume: bool = Field(True, description="a starting trainer continues from the latest valid checkpoint")
    resume_step: int | None = Field(
        None,
        ge=0,
        description="continue from this step instead of the latest, once: a restart after that resume (the "
        "launcher's, or a later --resume) continues from the newest step",
    )
    resume_wait_s: float = Field(
        300.0,
        ge=0,
        description="seconds a resuming trainer waits for a checkpoint store it cannot read (or that lacks the "
        "step this run's own record says it saved) before it refuses to start; it never starts from base weights",
    )
    s3_endpoint: str = Field("", description="host:port of the S3 endpoint for s3:// URLs")
    s3_secure: bool = Field(True, description="speak HTTPS to s3_endpoint; false = plain HTTP (a local MinIO)")
    s3_region: str = Field("us-east-1", description="the S3 region requests are signed for")
    s3_part_mib: int = Field(16, ge=5, description="multipart part size; larger objects upload in parallel parts")
    s3_parallel_uploads: int = Field(4, ge=1, description="multipart parts one upload sends at once (parts)")
    mirror_url: str = Field(
        "", description="a second store (file:// or s3:// on the same endpoint) that gets a copy of every step"
    )
    min_free_mib: int = Field(
        1024,
        ge=0,
        description="free space a save needs at least on the runs directory (and a file:// store) when no "
        "checkpoint has been saved yet to measure; the disk_space_low alert fires below twice what a save needs",
    )

    @field_validator("store_url", "mirror_url")
    @classmethod
    def _scheme(cls, url: str) -> str:
        if url and not re.match(r"^(file|s3)://.+", url):
            raise ValueError(f"{url!r} must start with file:// or s3://")
        return url


class S3Credentials(BaseSettings):
    """Read only from the environment or a secrets file, never from YAML, never logged."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_S3_", extra="ignore", secrets_dir=SECRETS_DIRS)
    access_key: str = Field("", repr=False, description="S3 access key id (RLPIPE_S3_ACCESS_KEY)")
    secret_key: str = Field("", repr=False, description="S3 secret access key (RLPIPE_S3_SECRET_KEY)")


class NatsConfig(Section):
    url: str = Field("nats://127.0.0.1:4222", description="the broker: nats://host:port, or tls://host:port for TLS")
    nkey_seed_file: Path | None = Field(
        None,
        description="file holding this service's NATS nkey seed (SU...), readable by it alone; the broker admits that "
        "key with its role's permissions only (services/common/transport/nats_auth.py). rlpipe run generates "
        "one per role; null connects without authentication",
    )
    tls_ca_file: Path | None = Field(
        None, description="PEM CA bundle the broker's certificate must chain to (a tls:// url); null: system CAs"
    )
    storage: Literal["file", "memory"] = Field(
        "file", description="where streams and buckets keep their messages; memory loses them when the broker stops"
    )
    stream_replicas: int = Field(
        1, ge=1, le=5, description="copies of every stream and bucket in a NATS cluster (3 in production)"
    )
    sync_always: bool = Field(
        False,
        description="embedded nats-server fsyncs every write (sync_interval: always); the default 2 min "
        "interval can lose acknowledged messages on power loss. Production brokers must set it in their own config.",
    )
    ack_wait_s: float = Field(60.0, gt=0, description="time a stage has to finish a message before redelivery")
    max_deliver: int = Field(
        5, ge=1, description="deliveries of one message before it is dead-lettered with reason max_deliver (count)"
    )
    max_ack_pending: int = Field(
        256, ge=1, description="messages one stage's consumer may hold unacknowledged across its replicas (count)"
    )
    duplicate_window_s: float = Field(
        1800.0,
        gt=0,
        description="how long JetStream remembers a message id to drop a repeated publish (seconds); longer than "
        "ack_wait_s * max_deliver",
    )
    dead_letter_max_age_s: float = Field(
        14 * 86400.0,
        gt=0,
        description="DEAD keeps a dead letter this long for `rlpipe dead-letters` to list or re-inject, then drops it",
    )
    heartbeat_s: float = Field(10.0, gt=0, description="in_progress() interval during long work")
    max_work_s: float = Field(
        900.0,
        gt=0,
        description="longest a stage may compute one batch: past it the work is abandoned and the messages nakked "
        "with backoff (DEAD with reason timeout after max_deliver tries); a loop without progress for twice this "
        "long reports NOT_SERVING on its gRPC health, so liveness probes restart it",
    )
    fetch_timeout_s: float = Field(
        1.0, gt=0, description="longest one pull of a stage waits for messages before it looks around again (seconds)"
    )
    max_message_bytes: int = Field(
        512 * 1024, ge=1024, description="larger messages are dead-lettered (server max is 1 MiB)"
    )
    claim_check_bytes: int = Field(
        256 * 1024, ge=512, description="a larger group goes to the object store and the message carries its key"
    )
    max_claim_bytes: int = Field(
        256 << 20,
        ge=1024,
        description="bytes; a claim-checked body declared larger is dead-lettered unread, and a stored one is read "
        "no further than its declared size",
    )

    @field_validator("nkey_seed_file", "tls_ca_file")
    @classmethod
    def _readable_file(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"file {str(path)!r} does not exist")
        return path

    @model_validator(mode="after")
    def _claims_below_the_limit(self) -> NatsConfig:
        if self.claim_check_bytes >= self.max_message_bytes:
            raise ValueError(
                "claim_check_bytes must be below max_message_bytes, or large groups would be dead-lettered"
            )
        if self.max_claim_bytes <= self.claim_check_bytes:
            raise ValueError("max_claim_bytes must be above claim_check_bytes, or every claim-checked group is refused")
        return self

    @model_validator(mode="after")
    def _heartbeat_within_ack_wait(self) -> NatsConfig:
        if self.heartbeat_s >= self.ack_wait_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be below ack_wait_s ({self.ack_wait_s}), "
                "or long work is redelivered while it still runs"
            )
        return self

    @model_validator(mode="after")
    def _dedup_outlives_redelivery(self) -> NatsConfig:
        if self.duplicate_window_s <= self.ack_wait_s * self.max_deliver:
            raise ValueError(
                "duplicate_window_s must be longer than ack_wait_s * max_deliver "
                f"({self.ack_wait_s} * {self.max_deliver}) so a redelivered compute cannot publish twice"
            )
        return self


class RolloutConfig(Section):
    backend: Literal["vllm", "hf"] = Field(
        "vllm",
        description="the generation engine: vllm, or hf (Hugging Face generate, slow, for machines without vLLM)",
    )
    replicas: int = Field(1, ge=1, description="rollout processes `rlpipe run` starts (count)")
    lora: Literal["auto", "adapter", "merge"] = Field(
        "auto",
        description="with model.lora, how the rollout serves each synced adapter: adapter = vLLM hot-loads it as a "
        "LoRA adapter over the untouched base; merge = it is merged into the base weights (W + alpha/r * B @ A, from a "
        "kept copy of the base); auto = adapter where the vLLM engine can serve LoRA, else merge (the hf backend "
        "always merges). The rollout's ready event names the one in force",
    )
    prompts_per_batch: int = Field(32, ge=1, description="prompts pulled and generated together")
    kv_cache_mib: int | None = Field(
        256,
        ge=16,
        description="vLLM KV-cache memory; null = what gpu_memory_utilization leaves after weights and activations "
        "(on a GPU; vLLM's CPU backend reads it as a share of host memory)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype the rollout serves and pulls weights in; auto = model.dtype, the trainer's"
    )
    weight_buffer_mib: int = Field(
        64, ge=1, description="tensors received but not yet loaded during a weight sync (plus one larger tensor)"
    )
    weight_relay: bool = Field(
        True,
        description="join the trainer's relay tree: pull each version from a peer or the trainer as told, and serve "
        "it to peers (a relaying replica holds one host copy of the model in the wire dtype)",
    )
    relay_host: str = Field(
        "", description="host peers reach this replica's gRPC port at (the pod IP in k8s); empty = service.host"
    )
    relay_fanout: int = Field(
        2, ge=0, description="replicas the trainer, and each relaying replica, send a version to; 0 = all from trainer"
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="share of each GPU's memory vLLM may take for weights, activations and KV cache (vLLM's own "
        "default); lower it when the trainer or reference shares the GPU",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one vLLM engine shards its model across")
    environment: str = Field(
        "",
        description="multi-turn episodes (docs/agents.md): a built-in environment (calculator, python) or a "
        "'module:Class' plugin; empty = single-turn completions",
    )
    environment_url: str = Field(
        "",
        pattern=r"^(https?://\S+)?$",
        description="an environment served over HTTP (docs/agents.md) instead of rollout.environment; empty = none",
    )
    environment_timeout_s: float = Field(
        10.0, gt=0, description="seconds one reset or step of the environment may take; past it the episode ends"
    )
    environment_retries: int = Field(
        2, ge=0, description="retries of a failed HTTP environment request before the episode ends as env_error"
    )
    max_turns: int = Field(4, ge=1, description="model turns in one episode (turns)")
    max_tokens_per_turn: int = Field(128, ge=1, description="tokens the model may sample in one turn (tokens)")
    max_total_tokens: int = Field(
        512, ge=1, description="tokens after the prompt in one episode, model turns and observations together (tokens)"
    )
    max_observation_tokens: int = Field(
        256, ge=1, description="tokens one observation may have; a longer one ends the episode as truncated (tokens)"
    )
    turn_stop: list[str] = Field(
        default_factory=list,
        description="strings that end a model turn and hand it to the environment, such as a tool call's closing "
        "tag '</calc>'; the model's end-of-sequence token always ends the episode",
    )

    @field_validator("environment")
    @classmethod
    def _environment_known(cls, environment: str) -> str:
        if ":" in environment:  # a plugin: imported now, so a typo stops the start rather than the first episode
            registry.import_function(environment)
        elif environment and environment not in registry.ENVIRONMENTS:
            raise ValueError(
                f"environment {environment!r} is not one of {list(registry.ENVIRONMENTS)} nor a 'module:Class'"
            )
        return environment

    @model_validator(mode="after")
    def _episode_budgets_fit(self) -> RolloutConfig:
        if self.environment and self.environment_url:
            raise ValueError("set rollout.environment or rollout.environment_url, not both")
        if self.max_tokens_per_turn > self.max_total_tokens:
            raise ValueError(
                f"rollout.max_tokens_per_turn={self.max_tokens_per_turn} must be at most "
                f"rollout.max_total_tokens={self.max_total_tokens}"
            )
        if any(not stop for stop in self.turn_stop):
            raise ValueError("rollout.turn_stop may not hold an empty string: it would end every turn at once")
        return self

    @property
    def multi_turn(self) -> bool:
        """Episodes with an environment rather than one completion per sample."""
        return bool(self.environment or self.environment_url)


class RewardModelConfig(Section):
    """A Hugging Face sequence classifier scoring (prompt, completion) pairs; see docs/rewards.md."""

    path: Path = Field(description="AutoModelForSequenceClassification folder (config.json, weights, tokenizer)")
    weight: float = Field(1.0, description="its score's weight in the reward, beside reward.functions")
    batch_size: int = Field(16, ge=1, description="pairs per forward pass")
    max_length: int = Field(512, ge=8, description="tokens per pair; longer ones lose their start, keeping the answer")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = CUDA when this replica sees a GPU; cuda without one stops the replica at start"
    )
    normalize: bool = Field(
        True, description="score = sigmoid(logit), in (0, 1) like the rule functions; false = the raw logit"
    )

    @field_validator("path")
    @classmethod
    def _folder_with_config(cls, path: Path) -> Path:
        if not (path / "config.json").is_file():
            raise ValueError(f"reward model folder {str(path)!r} does not exist or has no config.json")
        return path


class RewardHttpConfig(Section):
    """A remote reward service: batched JSON POSTs of (prompt, completion, answer, metadata) -> scores."""

    url: str = Field(pattern=r"^https?://\S+$", description="the endpoint taking the POST (docs/rewards.md)")
    weight: float = Field(1.0, description="its score's weight in the reward, beside reward.functions")
    timeout_s: float = Field(10.0, gt=0, description="one request's limit; a slower answer counts as a failure")
    retries: int = Field(2, ge=0, description="retries of a failed request before the group waits for the service")
    backoff_s: float = Field(0.5, gt=0, description="wait before the first retry, doubled for each next one")
    max_concurrency: int = Field(4, ge=1, description="requests in flight at once from one replica")
    batch_size: int = Field(64, ge=1, description="completions per request")
    headers_from_env: dict[str, str] = Field(
        default_factory=dict,
        description="header name -> environment variable holding its value (a token stays out of the YAML)",
    )
    token_file: Path | None = Field(
        None,
        description="file holding the bearer token sent as 'Authorization: Bearer <token>', read before each batch: "
        "rewrite it, or point this field at another file (live), to rotate the token without a restart",
    )
    max_response_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="bytes; a longer answer is the service's fault (the groups wait) and is never read whole",
    )
    _headers: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _headers_set_in_environment(self) -> RewardHttpConfig:
        if self.token_file is not None and any(name.lower() == "authorization" for name in self.headers_from_env):
            raise ValueError("token_file and headers_from_env both set the Authorization header: keep one")
        if not read_environment.get():  # a live override checked elsewhere: this replica resolved them at start
            return self
        # At start only: a live change is validated by the trainer's admin, on a host where this file need not be.
        if self.token_file is not None and not self.token_file.is_file():
            raise ValueError(f"token_file {str(self.token_file)!r} is not a readable file")
        missing = [variable for variable in self.headers_from_env.values() if variable not in os.environ]
        if missing:
            raise ValueError(f"headers_from_env names environment variables that are not set: {missing}")
        self._headers = {header: os.environ[variable] for header, variable in self.headers_from_env.items()}
        return self

    @property
    def headers(self) -> dict[str, str]:
        """The request headers, their values read from the environment when the config was loaded."""
        return dict(self._headers)


class OverlongPenaltyConfig(Section):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476), scored as the reward part ``overlong``."""

    max_tokens: int = Field(ge=1, description="a completion of more model tokens than this scores -1 (tokens)")
    buffer_tokens: int = Field(
        ge=1,
        description="the soft zone below max_tokens: over max_tokens - buffer_tokens the score falls linearly from 0 "
        "to -1 at max_tokens (tokens)",
    )
    weight: float = Field(1.0, gt=0, description="its score's weight in the reward, beside reward.functions")

    @model_validator(mode="after")
    def _buffer_inside_the_limit(self) -> OverlongPenaltyConfig:
        if self.buffer_tokens > self.max_tokens:
            raise ValueError(
                f"buffer_tokens ({self.buffer_tokens}) must be at most max_tokens ({self.max_tokens}): the soft zone "
                "lies below the limit"
            )
        return self


class RewardConfig(Section):
    functions: dict[str, float] = Field(
        default_factory=lambda: {"exact_match": 1.0},
        description="name or 'module:function' import path -> weight (docs/rewards.md)",
    )
    function_timeout_s: float = Field(
        10.0, gt=0, description="one function on one completion; past it that score is 0 and the call is killed"
    )
    model: RewardModelConfig | None = Field(None, description="a reward model, scored as 'model'")
    http: RewardHttpConfig | None = Field(None, description="a remote reward service, scored as 'http'")
    overlong_penalty: OverlongPenaltyConfig | None = Field(
        None, description="penalise completions near or past a length limit, scored as 'overlong'; null: off"
    )
    replicas: int = Field(1, ge=1, description="reward processes `rlpipe run` starts (count)")
    batch: int = Field(64, ge=1, description="rollout groups one reward replica pulls and scores together (groups)")
    max_abs_reward: float = Field(
        100.0,
        gt=0,
        description="largest |reward| a completion may get (reward units: the weighted sum of the parts); a group "
        "with a larger or non-finite one is an input fault, dead-lettered with the reason instead of trained on",
    )

    @field_validator("functions")
    @classmethod
    def _plugins_import(cls, functions: dict[str, float]) -> dict[str, float]:
        for name in functions:
            if ":" in name:  # a plugin: imported now, so a typo stops the start rather than the first group
                registry.import_function(name)
        return functions

    @model_validator(mode="after")
    def _some_reward(self) -> RewardConfig:
        if not self.functions and self.model is None and self.http is None:
            raise ValueError("no reward: name reward.functions, a reward.model or a reward.http service")
        taken = {"model", "http", "overlong"} & set(self.functions)
        if taken:
            raise ValueError(
                f"reward.functions may not use the names {sorted(taken)}: they name the model, http and overlong parts"
            )
        return self


class ReferenceConfig(Section):
    model_path: Path | None = Field(None, description="defaults to model.path")
    replicas: int = Field(1, ge=1, description="reference processes `rlpipe run` starts (count)")
    batch: int = Field(32, ge=1, description="scored groups one reference replica pulls and runs together (groups)")


class ServiceConfig(Section):
    host: str = Field("127.0.0.1", description="address this service's gRPC servers bind and announce")
    instance: str = Field("", description="this replica's name in status and metrics; defaults to <role>-<hostname>")
    trainer_grpc_port: int = Field(
        50051,
        ge=0,
        le=65535,
        description="WeightSync server; 0: the trainer binds a free port and a rollout reads it from the trainer's "
        "presence entry (how rlpipe run starts the rollouts together with the trainer)",
    )
    trainer_host: str = Field(
        "", description="where other services reach the trainer (a service name in compose/k8s); defaults to host"
    )
    grpc_port: int = Field(0, ge=0, le=65535, description="health port of non-trainer services; 0 = any free port")
    torch_threads: int = Field(1, ge=1, description="CPU threads torch may use in this process (threads)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="the least severe log records written"
    )
    log_max_mib: int = Field(
        100, ge=1, description="`rlpipe run` rotates a service's log file in <runs_dir>/<run>/logs past this size"
    )
    log_keep: int = Field(5, ge=0, description="rotated log files kept per service (<name>.log.1 is the newest)")


class AdminConfig(Section):
    port: int = Field(50052, ge=0, le=65535, description="Admin gRPC port on the trainer (0 = any free port)")
    token_file: Path | None = Field(None, description="file holding the bearer token; RLPIPE_ADMIN_TOKEN wins over it")
    tls_cert: Path | None = Field(None, description="PEM certificate chain; with tls_key, the admin port speaks TLS")
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> AdminConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("set both tls_cert and tls_key, or neither")
        for path in (self.tls_cert, self.tls_key, self.token_file):
            if path is not None and not path.is_file():
                raise ValueError(f"file {str(path)!r} does not exist")
        return self


class AdminCredentials(BaseSettings):
    """The admin bearer token, only from the environment, a secrets file or admin.token_file, never from YAML."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_ADMIN_", extra="ignore", secrets_dir=SECRETS_DIRS)
    token: str = Field(
        "", repr=False, description="the admin bearer token (RLPIPE_ADMIN_TOKEN); empty = admin.token_file"
    )


class WeightSyncConfig(Section):
    """TLS of the trainer's WeightSync port; the run's token (RLPIPE_WEIGHTSYNC_TOKEN) is a credential, not config."""

    tls_cert: Path | None = Field(
        None, description="PEM certificate chain; with tls_key, the trainer's WeightSync port speaks TLS only"
    )
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")
    tls_ca: Path | None = Field(
        None, description="PEM CA a rollout checks the trainer's WeightSync certificate against; set = connect by TLS"
    )

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> WeightSyncConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("set both tls_cert and tls_key, or neither")
        for path in (self.tls_cert, self.tls_key, self.tls_ca):
            if path is not None and not path.is_file():
                raise ValueError(f"file {str(path)!r} does not exist")
        return self


class WeightSyncCredentials(BaseSettings):
    """The run's weight-sync token, only from the environment or a secrets file, never from YAML: the trainer and
    the rollouts hold it, the other roles do not."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_WEIGHTSYNC_", extra="ignore", secrets_dir=SECRETS_DIRS)
    token: str = Field(
        "",
        repr=False,
        description="bearer token every WeightSync call must carry (RLPIPE_WEIGHTSYNC_TOKEN); empty = the port is "
        "open (refused in prod)",
    )


class TelemetryConfig(Section):
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus endpoint of each service (0 = any free port)")
    otlp_endpoint: str = Field(
        "", description="host:port of an OTLP/gRPC collector for traces and metrics; empty = none"
    )
    export_interval_s: float = Field(10.0, gt=0, description="OTLP metric export interval")
    jsonl_max_mib: int = Field(
        256,
        ge=1,
        description="metrics.jsonl and events.jsonl roll to numbered parts (metrics.00001.jsonl, ...) past this "
        "size; every part is kept and every reader (report, metrics --follow, tune, alert drill, tests) reads them "
        "in order",
    )
    samples_keep_steps: int = Field(
        50,
        ge=0,
        description="steps whose applied groups the trainer keeps in runs/<run>/samples/step_<N>.jsonl for "
        "`rlpipe samples` (prompts, completions, rewards, logprob and KL summaries); 0 keeps none",
    )
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="experiment trackers the trainer sends every metrics row, config version, alert and checkpoint "
        "to, under the run id, metric names in the actor/ critic/ reward/ response_length/ namespaces "
        "(docs/metrics.md); each needs the `trackers` extra",
    )
    mlflow_tracking_uri: str = Field(
        "", description="MLflow store or server; empty = sqlite:///<run dir>/mlflow.db, a local store without a server"
    )
    mlflow_experiment: str = Field("rlpipe", min_length=1, description="MLflow experiment the run is logged under")
    wandb_project: str = Field("rlpipe", min_length=1, description="W&B project the run is logged under")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline writes <run dir>/wandb for `wandb sync`; online needs W&B credentials (WANDB_API_KEY)",
    )

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once_and_installed(cls, trackers: list[str]) -> list[str]:
        if len(trackers) != len(set(trackers)):
            raise ValueError(f"names a tracker twice: {trackers}")
        # Looked up, not imported: the trainer imports them when it opens the trackers.
        missing = [name for name in trackers if importlib.util.find_spec(name) is None]
        if missing:
            raise ValueError(f"{missing} not installed: pip install 'rlpipe[trackers]'")
        return trackers


class TrainerConfig(Section):
    nproc: int = Field(
        1,
        ge=1,
        description="trainer processes on this machine, one per device: above 1, `rlpipe run` starts the trainer "
        "under torchrun and FSDP2 shards the policy (and critic) across them (on the CPU: processes on gloo); at "
        "most the GPUs this machine has when the model runs on CUDA. Restart-only",
    )
    lease_ttl_s: float = Field(
        15.0,
        gt=0,
        description="seconds the trainer's lease on its run lasts unrenewed (renewed every third of it): a second "
        "trainer of the run is refused while it holds; a restarted one takes over at most this long after its "
        "killed predecessor stopped renewing; a holder paused past it writes nothing more. Restart-only",
    )
    takeover_from: str = Field(
        "",
        description="the lease holder (host:pid) of this run's previous trainer, known dead: its lease is taken at "
        "once instead of after lease_ttl_s. `rlpipe run` sets it when it restarts a trainer it has waited on; "
        "set it by hand only for a trainer you know has exited",
    )


class CostConfig(Section):
    per_device_hour: dict[Literal["cpu-core", "gpu"], float] = Field(
        default_factory=dict,
        description="price of one hour of each device kind the run uses (your currency): cpu-core (one core busy "
        "for an hour, measured from the processes' CPU time) and gpu (one GPU held for an hour, from NVML). With "
        "both kinds the run used priced, the run summary and report show the cost, per step and per held-out "
        "accuracy point gained; device-hours per role are shown either way",
    )

    @field_validator("per_device_hour")
    @classmethod
    def _prices_not_negative(cls, prices: dict[str, float]) -> dict[str, float]:
        negative = sorted(kind for kind, price in prices.items() if price < 0)
        if negative:
            raise ValueError(f"a price cannot be negative: {negative}")
        return prices


class SupervisionConfig(Section):
    """How ``rlpipe run`` restarts the services it started, and how long it lets them stop."""

    max_restarts: int = Field(
        10,
        ge=0,
        description="restarts of one service within restart_window_s; one more and the run is declared failed",
    )
    restart_window_s: float = Field(
        3600.0,
        gt=0,
        description="the sliding window max_restarts counts over: a service that crashes once a day runs for ever, "
        "one in a crash loop fails the run",
    )
    backoff_s: float = Field(
        1.0, gt=0, description="first restart delay, doubled for each earlier restart still in the window"
    )
    max_backoff_s: float = Field(
        30.0, gt=0, description="longest delay before a restart, however many came before (seconds)"
    )
    trainer_stop_grace_s: float = Field(
        300.0,
        gt=0,
        description="on stop, how long the trainer may take after SIGTERM before SIGKILL: it saves a final "
        "checkpoint, which for a large model takes minutes",
    )
    stop_grace_s: float = Field(
        20.0, gt=0, description="on stop, how long every other service may take after SIGTERM before SIGKILL"
    )

    @model_validator(mode="after")
    def _window_outlasts_the_backoff(self) -> SupervisionConfig:
        # The restarts of a crash loop are spaced by their backoff; if max_restarts of them cannot fit in the
        # window, the count in the window never exceeds max_restarts and the loop goes on for ever.
        backoff = sum(min(self.backoff_s * 2**k, self.max_backoff_s) for k in range(self.max_restarts))
        if self.restart_window_s <= backoff:
            raise ValueError(
                f"restart_window_s ({self.restart_window_s:g}) must be longer than the backoff of max_restarts "
                f"restarts ({backoff:g}s with backoff_s={self.backoff_s:g}, max_backoff_s={self.max_backoff_s:g}), "
                "or a service in a crash loop is restarted for ever"
            )
        return self


class RunConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid")

    run_id: str = Field(
        "run",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="names the run's streams, buckets, checkpoint prefix and run directory (1-64 letters, digits, "
        "_ or -)",
    )
    environment: Literal["dev", "test", "prod"] | None = Field(
        None, description="the deployment this config is for; a run refuses it when RLPIPE_ENV names another"
    )
    runs_dir: Path = Field(
        Path("runs"), description="folder of run directories (logs, metrics, samples; file:// checkpoints by default)"
    )
    metrics_path: Path | None = Field(None, description="defaults to <runs_dir>/<run_id>/metrics.jsonl")
    model: ModelConfig = Field(description="the policy model")
    data: DataConfig = Field(description="the prompts to train and evaluate on")
    sampling: SamplingConfig = Field(SamplingConfig(), description="how rollouts sample completions")
    train: TrainConfig = Field(TrainConfig(), description="the learning algorithm and its optimizer")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="where and how often checkpoints are kept")
    nats: NatsConfig = Field(NatsConfig(), description="the broker and its streams")
    rollout: RolloutConfig = Field(RolloutConfig(), description="the rollout role and its engine")
    reward: RewardConfig = Field(RewardConfig(), description="the reward role: functions, a model, a remote service")
    reference: ReferenceConfig = Field(ReferenceConfig(), description="the reference role")
    service: ServiceConfig = Field(ServiceConfig(), description="ports, hosts and logs every service shares")
    trainer: TrainerConfig = Field(TrainerConfig(), description="the trainer's processes")
    supervision: SupervisionConfig = Field(
        SupervisionConfig(), description="how `rlpipe run` restarts and stops services"
    )
    admin: AdminConfig = Field(AdminConfig(), description="the trainer's Admin gRPC API")
    weight_sync: WeightSyncConfig = Field(
        WeightSyncConfig(), description="TLS of the trainer's WeightSync port (its token: RLPIPE_WEIGHTSYNC_TOKEN)"
    )
    telemetry: TelemetryConfig = Field(TelemetryConfig(), description="metrics endpoints, files and trackers")
    alerts: AlertsConfig = Field(AlertsConfig(), description="alert rules and where firings go")
    cost: CostConfig = Field(CostConfig(), description="prices per device-hour, for the run's cost lines")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML arrives as init kwargs; the environment must override it.
        return (env_settings, init_settings) if read_environment.get() else (init_settings,)

    @model_validator(mode="after")
    def _lost_only_after_every_delivery(self) -> RunConfig:
        # A group a stage may still legitimately redeliver must not be written off as lost.
        retrying_s = self.nats.ack_wait_s * self.nats.max_deliver
        if self.train.lost_after_s <= retrying_s:
            raise ValueError(
                f"train.lost_after_s ({self.train.lost_after_s}) must exceed nats.ack_wait_s x nats.max_deliver "
                f"({retrying_s}): a group that stages still retry would be recorded as lost"
            )
        return self

    @field_validator("reward")
    @classmethod
    def _known_reward_functions(cls, reward: RewardConfig) -> RewardConfig:
        for name in reward.functions:
            if ":" not in name:  # import paths are checked by RewardConfig
                one_of(name, registry.REWARD_FUNCTIONS.names())
        return reward

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run_id

    @property
    def metrics_file(self) -> Path:
        return self.metrics_path or self.run_dir / "metrics.jsonl"

    @property
    def checkpoint_url(self) -> str:
        return self.checkpoint.store_url or self.runs_dir.resolve().as_uri()

    @property
    def reference_model_path(self) -> Path:
        return self.reference.model_path or self.model.path

    @property
    def trainer_address(self) -> str:
        return f"{self.service.trainer_host or self.service.host}:{self.service.trainer_grpc_port}"


class BuildInfo(BaseSettings):
    """What is running: baked into images as RLPIPE_BUILD_VERSION / RLPIPE_BUILD_REVISION, reported by status."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_BUILD_", extra="ignore")
    version: str = Field("", description="the package version; empty = the installed rlpipe's")
    revision: str = Field("", description="the source revision; empty = the git checkout's short hash")

    def resolved(self) -> BuildInfo:
        """Fill what the environment left empty from the installed package and the git checkout."""
        import importlib.metadata
        import subprocess

        version = self.version or importlib.metadata.version("rlpipe")
        revision = self.revision
        if not revision:
            try:
                revision = subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                    cwd=Path(__file__).parent,
                ).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                revision = ""
        return BuildInfo(version=version, revision=revision or "unknown")


class DeploymentEnvironment(BaseSettings):
    """``RLPIPE_ENV``: which deployment this machine belongs to (dev, test or prod)."""

    model_config = SettingsConfigDict(env_prefix="RLPIPE_", extra="ignore")
    env: str = Field("", description="this machine's deployment (dev, test or prod); empty = any")
