"""Reference: SCORED -> EXPERIENCE, adding the frozen reference model's logprob of every response token.

The frozen model runs on ``model.device`` with its weights in ``model.dtype``: it is never
updated, so it needs no float32 master copy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import numpy as np
import torch

from services.common.config import RunConfig
from services.common.model.modeling import (
    Precision,
    load_model,
    load_tokenizer,
    make_deterministic,
    pack,
    response_logits,
    split_by_tokens,
    token_logprobs,
)
from services.common.model.padding import pad_token_id
from services.common.observe.logs import Stopwatch
from services.common.observe.telemetry import current_telemetry
from services.common.service import announce_ready, join_run, serve_stage, start_grpc_server
from services.common.transport.bus import Bus
from services.common.transport.messages import ExperienceGroup, ScoredGroup, advance
from services.common.transport.stage import Stage
from services.common.transport.streams import EXPERIENCE, SCORED

log = logging.getLogger(__name__)


class ReferenceScorer:
    def __init__(self, cfg: RunConfig):
        if cfg.train.deterministic:
            make_deterministic(cfg.train.seed)
        # A sequence's logprobs depend, in their last bits, on how far its forward pass was padded: deterministic,
        # a pass never holds two groups, so what a group gets does not depend on what was pulled with it.
        self.per_group = cfg.train.deterministic
        path = cfg.reference_model_path
        self.precision = Precision.of(cfg.model)
        model = load_model(path, self.precision.param_dtype)
        # transformers wraps PreTrainedModel.to in functools.wraps(Module.to), which loses the bound self's type.
        self.model = model.to(self.precision.device).eval().requires_grad_(False)  # pyright: ignore[reportArgumentType]
        self.pad_id = pad_token_id(load_tokenizer(path))
        self.micro_batch_tokens = cfg.reference.micro_batch_tokens

    def passes(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """The indices into ``pairs`` each forward pass takes: all at once, or length-sorted within the token budget."""
        if self.micro_batch_tokens is None:
            return [list(range(len(pairs)))]
        lengths = torch.tensor([len(prompt) + len(response) for prompt, response in pairs])
        return [
            rows.tolist()
            for rows in split_by_tokens(
                torch.arange(len(pairs)), lengths, self.micro_batch_tokens, "reference.micro_batch_tokens"
            )
        ]

    def plan(self, groups: Sequence[ScoredGroup], pairs: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """The indices into ``pairs`` (every completion of ``groups``, in order) each forward pass takes: ``passes``
        over all of them, or with ``per_group`` over each group's alone."""
        if not self.per_group:
            return self.passes(pairs)
        plan, start = [], 0
        for group in groups:
            end = start + len(group.completions)
            plan += [[start + i for i in rows] for rows in self.passes(pairs[start:end])]
            start = end
        return plan

    @torch.no_grad()
    def __call__(self, groups: Sequence[ScoredGroup]) -> list[ExperienceGroup]:
        pairs = [(g.prompt_ids.tolist(), c.token_ids.tolist()) for g in groups for c in g.completions]
        flat: list[np.ndarray] = [np.empty(0, np.float32)] * len(pairs)
        for rows in self.plan(groups, pairs):
            batch = pack([pairs[i] for i in rows], self.pad_id).to(self.precision.device)
            logprobs = token_logprobs(response_logits(self.model, batch), batch.targets).cpu()
            for i, row in zip(rows, logprobs, strict=True):
                flat[i] = row[: len(pairs[i][1])].numpy().astype(np.float32)
        out, start = [], 0
        for group in groups:
            n = len(group.completions)
            out.append(advance(group, ExperienceGroup, ref_logprobs=flat[start : start + n]))
            start += n
        return out


async def main(cfg: RunConfig, stop: asyncio.Event) -> None:
    started = Stopwatch()
    scorer = ReferenceScorer(cfg)
    loaded_s = started()
    bus = await Bus(cfg, "reference").connect()
    server, address = await start_grpc_server(cfg, cfg.service.grpc_port)
    live, presence = await join_run(cfg, bus, "reference", grpc=address)

    async def compute(groups: list[ScoredGroup]) -> list[ExperienceGroup]:
        await live.refresh()  # nothing here is live; the version in force is still reported
        return await asyncio.to_thread(scorer, groups)

    stage = Stage(bus, SCORED, EXPERIENCE, ScoredGroup, compute, cfg.reference.batch, "reference")
    await announce_ready(
        presence,
        grpc=address,
        metrics_url=current_telemetry().metrics_url,
        model=str(cfg.reference_model_path),
        model_load_s=loaded_s,
        startup_s=started(),
    )
    await serve_stage(stage, stop, server, presence)
