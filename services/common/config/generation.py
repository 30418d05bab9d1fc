"""The generation sections: how completions are sampled, and the rollout role, its engine and its environments."""

from __future__ import annotations

from itertools import pairwise
from typing import Literal

from pydantic import Field, field_validator, model_validator

from services.common import registry
from services.common.config.base import Live, Restart, Section, Security


class SamplingConfig(Section):
    group_size: Restart[int] = Field(default=8, ge=1, description="completions per prompt (n)")
    temperature: Live[float] = Field(
        default=1.0,
        gt=0,
        description="softmax temperature of the rollout's sampling (unitless; 1 = the policy's own distribution)",
    )
    top_p: Live[float] = Field(
        default=1.0,
        gt=0,
        le=1,
        description="nucleus sampling (Holtzman et al. 2020, arXiv:1904.09751): sample from the smallest set of tokens "
        "whose probability sums to top_p (a probability; 1 = every token)",
    )
    max_new_tokens: Live[int] = Field(
        default=8, ge=1, description="most tokens one completion may generate (tokens); longer ones are truncated"
    )


class HfEngineConfig(Section):
    max_sequences_per_call: Restart[int | None] = Field(
        default=256,
        ge=1,
        description="the transformers engine (rollout.backend: hf) generates a batch's prompts x group_size "
        "sequences, or a turn of every live episode, in one generate call; above this many sequences it makes "
        "several, each of sequences of like length (memory: the KV cache grows with sequences x length). "
        "null = always one call",
    )
    cache: Restart[Literal["dynamic", "static"]] = Field(
        default="dynamic",
        description="the KV cache generate keeps: dynamic (grown token by token) or static (allocated ahead, kept "
        "by the engine, one per batch bucket, and reused call after call). On a CUDA device transformers compiles "
        "the decode step over a static cache (CUDA graphs, one per batch x cache length), which pays where kernel "
        "launches dominate a step (a small model on a large GPU); on a CPU it measured slower (docs/performance.md). "
        "Off until measured on a GPU",
    )
    static_bucket_tokens: Restart[int] = Field(
        default=64,
        ge=1,
        description="with cache: static, each call's contexts are left-padded, and its token limit raised, to "
        "multiples of this many tokens, and a kept cache grows in such steps (never shrinking), so calls of like "
        "prompts and limits share one cache length instead of compiling for every width (tokens)",
    )
    static_batch_buckets: Restart[list[int]] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256],
        description="with cache: static, the batch sizes a generate call runs at (sequences, ascending): a call's "
        "sequences are padded up to the smallest that holds them (above the largest, to a multiple of it; never past "
        "max_sequences_per_call) with copies of one of them whose outputs are dropped, so multi-turn turns and "
        "in-flight chunks, whose sequence counts vary, compile the decode step for these sizes only. [1] = no "
        "copies, every sequence count a shape of its own",
    )

    @field_validator("static_batch_buckets")
    @classmethod
    def _buckets_ascending(cls, buckets: list[int]) -> list[int]:
        if not buckets or buckets[0] < 1 or any(b <= a for a, b in pairwise(buckets)):
            raise ValueError(f"{buckets}: one batch size or more, each at least 1, in ascending order")
        return buckets


class RolloutConfig(Section):
    backend: Restart[Literal["vllm", "hf"]] = Field(
        default="vllm",
        description="the generation engine: vllm, or hf (Hugging Face generate, slow, for machines without vLLM)",
    )
    replicas: Restart[int | Literal["auto"]] = Field(
        default=1,
        description="rollout processes `rlpipe run` starts (count, at least 1). auto = the 'one GPU shared' "
        "placement of `rlpipe plan`: every role on one GPU, with as many rollout replicas as fit beside the trainer "
        "and the reference (at most auto_max_replicas), each role capped at its share of the GPU's memory "
        "(service.gpu_memory_fraction, the shares not set there taken from the plan); 1 on a machine without a GPU",
    )
    auto_max_replicas: Restart[int] = Field(
        default=4,
        ge=1,
        description="the most rollout replicas `rollout.replicas: auto` starts, however many fit in the GPU's "
        "memory: replicas on one GPU share its compute, so past a few the compute, not the memory, bounds them (count)",
    )
    lora: Restart[Literal["auto", "adapter", "merge"]] = Field(
        default="auto",
        description="with model.lora, how the rollout serves each synced adapter: adapter = vLLM hot-loads it as a "
        "LoRA adapter over the untouched base; merge = it is merged into the base weights (W + alpha/r * B @ A, from a "
        "kept copy of the base); auto = adapter where the vLLM engine can serve LoRA, else merge (the hf backend "
        "always merges). The rollout's ready event names the one in force",
    )
    prompts_per_batch: Restart[int] = Field(default=32, ge=1, description="prompts pulled and generated together")
    hf: HfEngineConfig = Field(default=HfEngineConfig(), description="the transformers engine's settings (backend: hf)")
    kv_cache_mib: Restart[int | None] = Field(
        default=256,
        ge=16,
        description="vLLM KV-cache memory; null = what gpu_memory_utilization leaves after weights and activations "
        "(on a GPU; vLLM's CPU backend reads it as a share of host memory)",
    )
    dtype: Restart[Literal["auto", "float32", "bfloat16", "float16"]] = Field(
        default="auto", description="dtype the rollout serves and pulls weights in; auto = model.dtype, the trainer's"
    )
    weight_buffer_mib: Restart[int] = Field(
        default=64,
        ge=1,
        description="tensors received but not yet loaded during a weight sync (plus one larger tensor)",
    )
    weight_relay: Restart[bool] = Field(
        default=True,
        description="join the trainer's relay tree: pull each version from a peer or the trainer as told, and serve "
        "it to peers (a relaying replica holds one host copy of the model in the wire dtype)",
    )
    relay_host: Security[str] = Field(
        default="", description="host peers reach this replica's gRPC port at (the pod IP in k8s); empty = service.host"
    )
    relay_fanout: Restart[int] = Field(
        default=2,
        ge=0,
        description="replicas the trainer, and each relaying replica, send a version to; 0 = all from trainer",
    )
    gpu_memory_utilization: Restart[float] = Field(
        default=0.9,
        gt=0,
        le=1,
        description="share of each GPU's memory vLLM may take for weights, activations and KV cache (vLLM's own "
        "default); lower it when the trainer or reference shares the GPU. service.gpu_memory_fraction.rollout, "
        "when set, replaces it",
    )
    tensor_parallel_size: Restart[int] = Field(
        default=1, ge=1, description="GPUs one vLLM engine shards its model across"
    )
    environment: Security[str] = Field(
        default="",
        description="multi-turn episodes (docs/agents.md): a built-in environment (calculator, python, no-tool) or a "
        "'module:Class' plugin; empty = single-turn completions",
    )
    environment_url: Security[str] = Field(
        default="",
        pattern=r"^(https?://\S+)?$",
        description="an environment served over HTTP (docs/agents.md) instead of rollout.environment; empty = none",
    )
    python_tool_isolation: Security[Literal["required", "allow_unisolated"]] = Field(
        default="required",
        description="security: where the python environment runs the code the model writes. required = only in its "
        "box (its own user, PID, network and mount namespaces: no view of this process, its environment, the run "
        "directory or the network; docs/agents.md, 'The box'), and a rollout or trainer on a machine that refuses "
        "user namespaces refuses to start, saying why; allow_unisolated = in the box where one can be built, else "
        "in a plain child process under the same limits but the process count, which can read the run's "
        "credentials and files and reach the network (a python_tool_unisolated warning says so at start; refused "
        "in prod)",
    )
    environment_timeout_s: Restart[float] = Field(
        default=10.0,
        gt=0,
        description="seconds one reset or step of the environment may take; past it the episode ends",
    )
    environment_retries: Restart[int] = Field(
        default=2, ge=0, description="retries of a failed HTTP environment request before the episode ends as env_error"
    )
    episode_batches: Restart[int] = Field(
        default=2,
        ge=1,
        le=16,
        description="multi-turn, or single-turn with inflight_updates: prompt batches a rollout replica runs at once "
        "(count). Each engine call takes every episode ready for a turn (every sample's next chunk) of all of them, "
        "so the next batch uses the engine while the last episodes of a batch wait on their environment (or its "
        "longest samples finish); a sync between a batch's turns makes its later turns the newer policy's, each "
        "token tagged with the version that sampled it. 1 = one batch at a time",
    )
    inflight_updates: Restart[bool] = Field(
        default=False,
        description="load a new policy version while a batch is generating instead of after it (docs/algorithms.md, "
        "'In-flight weight updates'): single-turn samples are generated inflight_chunk_tokens at a time and the "
        "newest version loaded between chunks, each sample going on from its kept tokens under the new weights; "
        "multi-turn episodes load it before each turn. Every token records the version that sampled it, which the "
        "trainer's staleness bound and off-policy corrections read per token. No effect with train.synchronous "
        "(no version is published while a batch generates)",
    )
    inflight_chunk_tokens: Restart[int] = Field(
        default=32,
        ge=1,
        description="with inflight_updates, the most new tokens of each sample one engine call generates (tokens): "
        "smaller loads versions sooner and costs more engine calls",
    )
    max_turns: Restart[int] = Field(default=4, ge=1, description="model turns in one episode (turns)")
    max_tokens_per_turn: Restart[int] = Field(
        default=128, ge=1, description="tokens the model may sample in one turn (tokens)"
    )
    max_total_tokens: Restart[int] = Field(
        default=512,
        ge=1,
        description="tokens after the prompt in one episode, model turns and observations together (tokens)",
    )
    max_observation_tokens: Restart[int] = Field(
        default=256,
        ge=1,
        description="tokens one observation may have; a longer one ends the episode as truncated (tokens)",
    )
    turn_stop: Restart[list[str]] = Field(
        default_factory=list,
        description="strings that end a model turn and hand it to the environment, such as a tool call's closing "
        "tag '</calc>'; the model's end-of-sequence token ends the episode too, unless rollout.observation_role "
        "is set",
    )
    observation_role: Restart[str] = Field(
        default="",
        pattern=r"^([A-Za-z_][A-Za-z0-9_-]*)?$",
        description="the chat role observations are sent in ('tool', 'user'), each wrapped by the model's chat "
        "template after the model's message and followed by the next assistant message's opening; the model's "
        "end-of-sequence token then ends its message, not the episode. Empty = observations appended verbatim",
    )

    @field_validator("replicas")
    @classmethod
    def _at_least_one_replica(cls, replicas: int | str) -> int | str:
        if isinstance(replicas, int) and replicas < 1:
            raise ValueError(f"{replicas} rollout replicas: at least 1, or auto")
        return replicas

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
