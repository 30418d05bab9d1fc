"""How one optimizer step's rows become forward passes: the micro-batches, and each rank's share of them.

Pure functions of the rows, their lengths and the train config (and, across processes, the mesh); the
``Learner`` (services/trainer/learning/learner.py) runs the passes they plan.

Micro-batches: the rows are split into ``grad_accum_steps`` equal-count chunks, or, with ``micro_batch_tokens``,
sorted by length and cut so each micro-batch's padded size fits the budget (``split_by_tokens``); each pads only to
its own longest sequence.

Across processes each rank takes its share of the rows (``Mesh.shares``). Every forward and backward of a sharded
model is collective, so a rank with fewer micro-batches than the busiest adds passes over a row that count for
nothing. Every rank holds the whole batch, so each works out every share's micro-batches itself, and they all
agree without asking each other.
"""

from __future__ import annotations

import torch

from services.common.config import TrainConfig
from services.common.model.modeling import split_by_tokens
from services.trainer.learning.batch import chunks_of
from services.trainer.learning.distributed import Mesh


def micro_batches(rows: torch.Tensor, lengths: torch.Tensor, train: TrainConfig) -> list[torch.Tensor]:
    """``rows`` (one optimizer step's, or all for scoring) in the micro-batches one forward pass takes;
    ``lengths`` holds every row's sequence length, indexed by row."""
    if train.micro_batch_tokens is None:
        return chunks_of(rows, train.grad_accum_steps)
    return split_by_tokens(rows, lengths[rows], train.micro_batch_tokens)


def rank_passes(
    rows: torch.Tensor, lengths: torch.Tensor, train: TrainConfig, mesh: Mesh
) -> list[tuple[torch.Tensor, bool]]:
    """This rank's forward passes over ``rows``: its share's micro-batches, each with whether it counts (alone,
    every micro-batch of ``rows``, all counting)."""
    plans = [micro_batches(share, lengths, train) if len(share) else [] for share in mesh.shares(rows)]
    mine = plans[mesh.rank]
    busiest = max(len(plan) for plan in plans)
    return [(micro, True) for micro in mine] + [(rows[:1], False)] * (busiest - len(mine))
