"""Generation backends behind one small interface: vLLM (default) and transformers ``generate``.

Both return, per prompt, ``n`` completions with their token ids (EOS included when
generation stopped on it), the sampled tokens' logprobs under the *raw* policy
(before temperature/top-p, as the trainer computes them) and the finish reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from services.common.config import RunConfig, SamplingConfig
from services.common.model.modeling import load_model, load_tokenizer
from services.common.transport.breaker import DependencyUnavailable


@dataclass
class Generation:
    text: str
    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    finish_reason: str  # "stop" | "length"


class Engine(Protocol):
    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, max_seq_len: int
    ) -> list[list[Generation]]: ...

    def generate_turns(
        self, contexts: list[list[int]], max_tokens: list[int], sampling: SamplingConfig, stop: list[str]
    ) -> list[Generation]:
        """One turn for each episode: one sample continuing each context, up to its ``max_tokens``, ending early on
        the end-of-sequence token or once the text holds one of ``stop``."""
        ...

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class EngineUnavailable(DependencyUnavailable):
    """The engine itself failed (died, lost its device): the prompts are fine, the stage holds them and retries."""


def serving_dtype(cfg: RunConfig) -> str:
    """The dtype the rollout's engine holds its weights in, and so the one to pull them in."""
    return cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype


def max_tokens_for(prompt_len: int, sampling: SamplingConfig, max_seq_len: int) -> int:
    room = max_seq_len - prompt_len
    if room < 1:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room under max_seq_len={max_seq_len}")
    return min(sampling.max_new_tokens, room)


def vllm_engine_args(cfg: RunConfig) -> dict[str, Any]:
    """vLLM's ``EngineArgs`` for the rollout's engine (what ``LLM(**...)`` takes)."""
    return {
        "model": str(cfg.model.path),
        "dtype": serving_dtype(cfg),
        "max_model_len": cfg.train.max_seq_len,
        "seed": cfg.train.seed,
        "enforce_eager": True,  # start-up in ~2 s instead of ~18 s, same generation speed at this size
        # A set KV-cache size wins over the share of memory vLLM would otherwise fill with it.
        "kv_cache_memory_bytes": None if cfg.rollout.kv_cache_mib is None else cfg.rollout.kv_cache_mib << 20,
        "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
        "tensor_parallel_size": cfg.rollout.tensor_parallel_size,
    }


class VllmEngine:
    """An in-process vLLM engine whose weights are replaced in place on each sync."""

    def __init__(self, cfg: RunConfig):
        # In-process engine: weight reloads reach the model runner directly, no worker IPC.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.llm = LLM(**vllm_engine_args(cfg))
        self.tokenizer = self.llm.get_tokenizer()

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, max_seq_len: int
    ) -> list[list[Generation]]:
        from vllm import SamplingParams, TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        params = [
            SamplingParams(
                n=sampling.group_size,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=max_tokens_for(len(ids), sampling, max_seq_len),
                logprobs=0,
            )
            for ids in prompt_ids
        ]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        return [[self._generation(out) for out in result.outputs] for result in results]

    def generate_turns(
        self, contexts: list[list[int]], max_tokens: list[int], sampling: SamplingConfig, stop: list[str]
    ) -> list[Generation]:
        from vllm import SamplingParams, TokensPrompt

        # One call for every live episode: vLLM batches them continuously, whatever their lengths.
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=limit,
                logprobs=0,
                stop=stop or None,
                include_stop_str_in_output=True,
            )
            for limit in max_tokens
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in contexts]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        return [self._generation(result.outputs[0]) for result in results]

    def _generation(self, out: Any) -> Generation:
        ids = list(out.token_ids)
        logprobs = [step[token].logprob for step, token in zip(out.logprobs, ids, strict=False)]
        return Generation(
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            token_ids=np.asarray(ids, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            finish_reason="length" if out.finish_reason == "length" else "stop",
        )

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consumes ``tensors`` lazily, so they can still be arriving: vLLM loads layer by layer as each
        layer's tensors are complete. An iterator that raises midway leaves layers unloaded (on the meta
        device): the caller must treat the engine as unusable until a complete load.

        Under tensor parallelism the workers are processes of their own, which get their arguments pickled, and a
        stream cannot be: the tensors are all received first, so the sync holds one more host copy of the model."""
        in_other_processes = self.llm.llm_engine.vllm_config.parallel_config.world_size > 1
        weights = list(tensors) if in_other_processes else iter(tensors)
        # reload_weights repacks for the CPU kernels; calling model.load_weights after start-up does not.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # Cached KV blocks were computed by the old weights.
        self.llm.reset_prefix_cache()


class HfEngine:
    """transformers ``generate``: slower, for machines without vLLM."""

    def __init__(self, cfg: RunConfig):
        self.model = load_model(cfg.model.path, serving_dtype(cfg)).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(cfg.model.path)
        torch.manual_seed(cfg.train.seed)

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, max_seq_len: int
    ) -> list[list[Generation]]:
        return [self._group(ids, sampling, max_tokens_for(len(ids), sampling, max_seq_len)) for ids in prompt_ids]

    @torch.no_grad()
    def generate_turns(
        self, contexts: list[list[int]], max_tokens: list[int], sampling: SamplingConfig, stop: list[str]
    ) -> list[Generation]:
        # One context at a time: generate pads a batch, and a padded context would change what the model sees.
        return [
            self._group(ids, sampling, limit, samples=1, stop=stop)[0]
            for ids, limit in zip(contexts, max_tokens, strict=True)
        ]

    def _group(
        self, ids: list[int], sampling: SamplingConfig, max_tokens: int, samples: int = 0, stop: list[str] | None = None
    ) -> list[Generation]:
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        prompt = torch.tensor([ids] * (samples or sampling.group_size))
        stopping = {"stop_strings": stop, "tokenizer": self.tokenizer} if stop else {}
        out = self.model.generate(
            **stopping,
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_new_tokens=max_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        new_tokens = out.sequences[:, len(ids) :]
        raw_logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1)
        token_logprobs = raw_logprobs.gather(-1, new_tokens[..., None]).squeeze(-1)
        group = []
        for tokens, logprobs in zip(new_tokens.tolist(), token_logprobs, strict=False):
            stop = tokens.index(eos) + 1 if eos in tokens else len(tokens)
            group.append(
                Generation(
                    text=self.tokenizer.decode(tokens[:stop], skip_special_tokens=True),
                    token_ids=np.asarray(tokens[:stop], dtype=np.int32),
                    logprobs=logprobs[:stop].numpy().astype(np.float32),
                    finish_reason="stop" if eos in tokens else "length",
                )
            )
        return group

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies each tensor into the model as it arrives (no second copy of the model), as strict as
        ``load_state_dict``: an unknown name or shape raises at once, a missing name at the end."""
        live = self.model.state_dict()  # shares storage with the parameters
        missing = set(live)
        for name, tensor in tensors:
            target = live.get(name)
            if target is None or target.shape != tensor.shape:
                got = "unknown name" if target is None else f"shape {list(tensor.shape)}, not {list(target.shape)}"
                raise KeyError(f"weights for {name!r} do not fit the model: {got}")
            target.copy_(tensor)
            missing.discard(name)
        if missing:
            raise KeyError(f"weights missing for {sorted(missing)}")


def build_engine(cfg: RunConfig) -> Engine:
    return VllmEngine(cfg) if cfg.rollout.backend == "vllm" else HfEngine(cfg)
