"""Generation backends behind one small interface: vLLM (default) and transformers ``generate``.

Both return, per prompt, ``n`` completions with their token ids (EOS included when
generation stopped on it), the sampled tokens' logprobs under the *raw* policy
(before temperature/top-p, as the trainer computes them) and the finish reason.

With ``model.lora`` a policy version is the adapter tensors alone (services/common/model/lora.py). vLLM hot-loads
each as a LoRA adapter under a new id and leaves the base weights untouched (``adapter``); where it cannot serve
LoRA, or ``rollout.lora: merge`` says so, the adapter is merged into the base weights from a kept copy of them
(``merge``). The hf backend always merges. ``lora_mode`` says which, for the ready event.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file

from services.common.config import ModelConfig, RolloutConfig, RunConfig, SamplingConfig
from services.common.episodes.generation import Generation
from services.common.model.batch_generation import generate_batch
from services.common.model.lora import AdapterMerger, write_adapter
from services.common.model.modeling import DTYPES, decode_text, load_model, load_tokenizer, resolve_device
from services.common.model.padding import eos_token_id, pad_token_id
from services.common.model.static_cache import StaticCaches
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.transport.breaker import DependencyUnavailable

log = logging.getLogger(__name__)
# The adapter ranks vLLM's max_lora_rank takes (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class WeightTarget(Protocol):
    """What a policy follower loads each synced version into."""

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class Engine(WeightTarget, Protocol):
    lora_mode: str  # "off" (full weights), "adapter" or "merge"
    end_tokens: frozenset[int]  # the tokens a generation ends on (end_token_ids)
    tokenizer: Any  # the model's: transformers' (hf), or the one vLLM generates with (a transformers one too)

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        max_seq_len: int,
        seeds: list[list[int]] | None = None,
    ) -> list[list[Generation]]:
        """``sampling.group_size`` samples of each prompt. With ``seeds`` (train.deterministic; ``seeds[p][i]`` is
        ``sampling_seed`` of prompt p's sample i), each sample draws from a generator of its own seeded with it, so
        it does not depend on what else the call holds; without, from the engine's shared stream."""
        ...

    def generate_turns(
        self,
        contexts: list[list[int]],
        max_tokens: list[int],
        sampling: SamplingConfig,
        stop: list[str],
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        """One turn for each episode: one sample continuing each context, up to its ``max_tokens``, ending early on
        the end-of-sequence token or once the text holds one of ``stop``; with ``seeds``, each drawn from a
        generator of its own seeded with ``seeds[i]``."""
        ...


class EngineUnavailable(DependencyUnavailable):
    """The engine itself failed (died, lost its device): the prompts are fine, the stage holds them and retries."""


def serving_dtype(model: ModelConfig, rollout: RolloutConfig) -> str:
    """The dtype the rollout's engine holds its weights in, and so the one to pull them in."""
    return model.dtype if rollout.dtype == "auto" else rollout.dtype


def end_token_ids(model_path: Path, eos_token_id: int | None) -> frozenset[int]:
    """The tokens vLLM ends a generation on: the tokenizer's EOS and every ``eos_token_id`` of the model's
    generation_config.json (a chat model may list its end-of-message token beside the end of text)."""
    ids = {eos_token_id} if eos_token_id is not None else set()
    config = Path(model_path) / "generation_config.json"
    if config.is_file():
        listed = json.loads(config.read_text()).get("eos_token_id")
        ids.update(listed if isinstance(listed, list) else [] if listed is None else [listed])
    return frozenset(ids)


def max_tokens_for(prompt_len: int, sampling: SamplingConfig, max_seq_len: int) -> int:
    room = max_seq_len - prompt_len
    if room < 1:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room under max_seq_len={max_seq_len}")
    return min(sampling.max_new_tokens, room)


def vllm_lora_rank(r: int) -> int | None:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of rank ``r``; None above them."""
    return next((rank for rank in VLLM_LORA_RANKS if rank >= r), None)


def vllm_engine_args(cfg: RunConfig, serve_lora: bool = False) -> dict[str, Any]:
    """vLLM's ``EngineArgs`` for the rollout's engine (what ``LLM(**...)`` takes); ``serve_lora``: with the LoRA
    support that hot-loads model.lora's adapters (one at a time: each version replaces the last)."""
    lora = {}
    if serve_lora and cfg.model.lora is not None:
        lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_lora_rank(cfg.model.lora.r)}
    return lora | {
        "model": str(cfg.model.path),
        "dtype": serving_dtype(cfg.model, cfg.rollout),
        "max_model_len": cfg.train.max_seq_len,
        "seed": cfg.train.seed,
        "enforce_eager": True,  # start-up in ~2 s instead of ~18 s, same generation speed at this size
        # A set KV-cache size wins over the share of memory vLLM would otherwise fill with it.
        "kv_cache_memory_bytes": None if cfg.rollout.kv_cache_mib is None else cfg.rollout.kv_cache_mib << 20,
        "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
        "tensor_parallel_size": cfg.rollout.tensor_parallel_size,
    }


def _model_weights(path: Path) -> dict[str, torch.Tensor]:
    """A Hugging Face model folder's tensors by name, in host memory (its safetensors files)."""
    return {name: t for file in sorted(Path(path).glob("*.safetensors")) for name, t in load_file(str(file)).items()}


class VllmEngine:
    """An in-process vLLM engine whose weights are replaced in place on each sync, or with LoRA which serves each
    synced adapter (see the module docstring)."""

    def __init__(self, cfg: RunConfig):
        # In-process engine: weight reloads reach the model runner directly, no worker IPC.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # vLLM's sampler compiles two small helpers (logprob ranks, top-k/top-p masking) with torch.compile on
            # its first batch. On the CPU backend that is an inductor C++ build inside this process before a run's
            # first group: 2.6-3.5 s on a quiet 2-core machine with inductor's cache warm (0.1 s eager), tens of
            # seconds cold or loaded, for a few element-wise ops. The model runs eager (enforce_eager) and nothing
            # else in a rollout compiles, so dynamo is turned off for the process: those helpers run eager.
            torch._dynamo.config.disable = True

        self.cfg = cfg
        self.lora_mode = "off"
        self.lora_request: Any = None  # the adapter generation runs under; None: the base (version 0)
        self.merger: AdapterMerger | None = None
        self.base: dict[str, torch.Tensor] = {}
        if cfg.model.lora is None:
            self.llm = LLM(**vllm_engine_args(cfg))
        elif cfg.rollout.lora != "merge" and vllm_lora_rank(cfg.model.lora.r) is not None:
            try:
                self.llm = LLM(**vllm_engine_args(cfg, serve_lora=True))
                self.lora_mode = "adapter"
            except Exception as error:  # a platform or model vLLM serves no LoRA on
                if cfg.rollout.lora == "adapter":
                    raise
                log_event(log, Event.LORA_ADAPTER_UNAVAILABLE, level=logging.WARNING, error=repr(error)[:300])
        if cfg.model.lora is not None and self.lora_mode == "off":
            self.llm = LLM(**vllm_engine_args(cfg))
            self.lora_mode = "merge"
            dtype = DTYPES.get(serving_dtype(cfg.model, cfg.rollout), torch.float32)
            # The whole base in host memory: vLLM reloads every weight at once, the merged ones among them.
            self.base = {name: t.to(dtype) for name, t in _model_weights(cfg.model.folder).items()}
            self.merger = AdapterMerger(self.base, cfg.model.lora)
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="rlpipe-lora-")) if self.lora_mode == "adapter" else None
        if self.adapter_dir is not None:  # the served adapter's folder goes with the engine (vLLM read it at load)
            weakref.finalize(self, shutil.rmtree, self.adapter_dir, True)
        self.adapters_loaded = 0
        self.tokenizer = self.llm.get_tokenizer()
        self.end_tokens = end_token_ids(cfg.model.folder, self.tokenizer.eos_token_id)

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        max_seq_len: int,
        seeds: list[list[int]] | None = None,
    ) -> list[list[Generation]]:
        from vllm import SamplingParams, TokensPrompt

        if seeds is not None:
            return self._generate_seeded(prompt_ids, sampling, max_seq_len, seeds)
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
        results = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        return [[self._generation(out) for out in result.outputs] for result in results]

    def _generate_seeded(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, max_seq_len: int, seeds: list[list[int]]
    ) -> list[list[Generation]]:
        """One request per sample, each with its own seed. (vLLM would seed a request of n samples as seed, seed + 1,
        ...: neighbouring groups' streams would overlap.) vLLM fans a request of n out into n requests anyway, and
        its prefix cache computes each prompt once."""
        from vllm import SamplingParams, TokensPrompt

        prompts, params = [], []
        for ids, sample_seeds in zip(prompt_ids, seeds, strict=True):
            limit = max_tokens_for(len(ids), sampling, max_seq_len)
            for seed in sample_seeds:
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        max_tokens=limit,
                        logprobs=0,
                        seed=seed,
                    )
                )
        results = iter(self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request))
        return [[self._generation(next(results).outputs[0]) for _ in sample_seeds] for sample_seeds in seeds]

    def generate_turns(
        self,
        contexts: list[list[int]],
        max_tokens: list[int],
        sampling: SamplingConfig,
        stop: list[str],
        seeds: list[int] | None = None,
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
                seed=None if seeds is None else seeds[i],
            )
            for i, limit in enumerate(max_tokens)
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in contexts]
        results = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
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
        if self.lora_mode == "adapter":
            self._hot_load(tensors)
            return
        in_other_processes = self.llm.llm_engine.vllm_config.parallel_config.world_size > 1
        if self.merger is not None:
            tensors = (self.base | self.merger.merged(tensors)).items()
        weights = list(tensors) if in_other_processes else iter(tensors)
        # reload_weights repacks for the CPU kernels; calling model.load_weights after start-up does not.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # Cached KV blocks were computed by the old weights.
        self.llm.reset_prefix_cache()

    def _hot_load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Serve the adapter ``tensors`` from the next generation on, under a new adapter id; the last one is
        removed. The base weights are not touched. An adapter that does not load leaves the previous one served."""
        from vllm.lora.request import LoRARequest

        lora = self.cfg.model.lora
        if self.adapter_dir is None or lora is None:
            raise RuntimeError("an adapter is hot-loaded only while vLLM serves model.lora as an adapter")
        number = self.adapters_loaded + 1
        folder = self.adapter_dir / f"v{number}"
        write_adapter(folder, lora, tensors, self.cfg.model.path)
        request = LoRARequest(f"policy-{number}", number, str(folder))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter at {folder}")
        previous, self.lora_request, self.adapters_loaded = self.lora_request, request, number
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        # Cached KV blocks were computed under the old adapter.
        self.llm.reset_prefix_cache()


class HfEngine:
    """transformers ``generate``, for machines without vLLM: a batch's prompts x group_size sequences in one call,
    and one call per turn for every live episode (``rollout.hf.max_sequences_per_call`` caps a call; above it,
    sequences of like length go together). Batched sequences are left-padded under an attention mask and their own
    position ids (``services.common.model.batch_generation``), so each gets the logprobs it would get alone.

    Seeded samples (train.deterministic) are each generated alone, from the device's generator set to the sample's
    seed: ``generate`` draws every row of a call from one generator, so a row's draws would depend on its
    neighbours. One call per sample is slower; a reproducible run pays that for draws that are its own.

    With ``rollout.hf.cache: static`` the engine keeps the static KV caches ``generate`` runs over, one per batch
    bucket (``services.common.model.static_cache``), and a call's sequences are padded up to their bucket with
    copies whose outputs are dropped. A seeded sample alone is a batch of 1, the smallest bucket by default: no
    copies draw beside it."""

    def __init__(self, cfg: RunConfig):
        model = load_model(cfg.model.folder, serving_dtype(cfg.model, cfg.rollout)).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(cfg.model.folder)
        self.pad_id = pad_token_id(self.tokenizer)
        self.end_tokens = end_token_ids(cfg.model.folder, eos_token_id(self.tokenizer))
        self.max_per_call = cfg.rollout.hf.max_sequences_per_call
        torch.manual_seed(cfg.train.seed)
        self.lora_mode = "off" if cfg.model.lora is None else "merge"
        # The merger's copy of the base stays on the host, where adapters arrive and are merged; the model goes to
        # model.device, as the trainer's and the reference's do.
        self.merger = AdapterMerger(model.state_dict(), cfg.model.lora) if cfg.model.lora is not None else None
        self.device = resolve_device(cfg.model.device)
        # transformers wraps PreTrainedModel.to in functools.wraps(Module.to), which loses the bound self's type.
        self.model = model.to(self.device)  # pyright: ignore[reportArgumentType]
        hf = cfg.rollout.hf
        self.static = (
            StaticCaches(model.config, hf.static_bucket_tokens, hf.static_batch_buckets, hf.max_sequences_per_call)
            if hf.cache == "static"
            else None
        )

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        max_seq_len: int,
        seeds: list[list[int]] | None = None,
    ) -> list[list[Generation]]:
        n = sampling.group_size
        contexts = [ids for ids in prompt_ids for _ in range(n)]
        limits = [max_tokens_for(len(ids), sampling, max_seq_len) for ids in prompt_ids for _ in range(n)]
        flat_seeds = None if seeds is None else [seed for sample_seeds in seeds for seed in sample_seeds]
        flat = self._sample(contexts, limits, sampling, [], flat_seeds)
        return [flat[start : start + n] for start in range(0, len(flat), n)]

    def generate_turns(
        self,
        contexts: list[list[int]],
        max_tokens: list[int],
        sampling: SamplingConfig,
        stop: list[str],
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        return self._sample(contexts, max_tokens, sampling, stop, seeds)

    def _sample(
        self,
        contexts: list[list[int]],
        limits: list[int],
        sampling: SamplingConfig,
        stop: list[str],
        seeds: Sequence[int | None] | None = None,
    ) -> list[Generation]:
        if seeds is None or all(seed is None for seed in seeds):
            return self._sample_together(contexts, limits, sampling, stop)
        generations = []
        for context, limit, seed in zip(contexts, limits, seeds, strict=True):
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices, device_type=self.device.type):
                if seed is not None:
                    torch.manual_seed(seed)
                generations += self._sample_together([context], [limit], sampling, stop)
        return generations

    def _sample_together(
        self, contexts: list[list[int]], limits: list[int], sampling: SamplingConfig, stop: list[str]
    ) -> list[Generation]:
        continuations = generate_batch(
            self.model,
            contexts,
            limits,
            pad_id=self.pad_id,
            end_tokens=self.end_tokens,
            stop=stop,
            decode=partial(decode_text, self.tokenizer),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_per_call=self.max_per_call,
            static=self.static,
        )
        return [
            Generation(
                text=decode_text(self.tokenizer, c.token_ids, skip_special_tokens=True),
                token_ids=np.asarray(c.token_ids, dtype=np.int32),
                logprobs=c.logprobs,
                finish_reason="stop" if c.stopped else "length",
            )
            for c in continuations
        ]

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies each tensor into the model as it arrives (no second copy of the model), as strict as
        ``load_state_dict``: an unknown name or shape raises at once, a missing name at the end. With LoRA the
        tensors are an adapter, merged into the base weights (all received before the first weight changes)."""
        live = self.model.state_dict()  # shares storage with the parameters
        if self.merger is not None:
            for name, weight in self.merger.merged(tensors).items():
                live[name].copy_(weight)
            return
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
