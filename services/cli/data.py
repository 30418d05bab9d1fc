"""``rlpipe data sample CONFIG``: N random rows of a run's dataset, as the model will see them.

Before a long run, an operator wants to see what the model will be asked: the row as stored, the prompt text after
the chat template (the exact string the rollout encodes, special tokens included), how many tokens it takes, and
the answer the reward compares with. The rows are read and rendered by the same code the trainer's feeder and the
evaluation use (``read_rows``, ``render_rows``), so what is printed is what is fed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from services.common.config import RunConfig
from services.common.model.chat import render_rows
from services.common.model.datasets import read_rows
from services.common.model.modeling import load_tokenizer

# A streamed dataset may be larger than memory: its sample is drawn from this many first rows, and says so.
STREAM_SAMPLE_WINDOW = 10_000


@dataclass(frozen=True)
class SampledRow:
    """One row as the model will see it."""

    index: int  # position in the split as read
    row_id: str
    prompt: str  # the text the model completes, after the chat template
    prompt_tokens: int  # encoded without added special tokens, as the rollout encodes it
    answer: Any
    messages: list[dict[str, Any]] | None  # the chat as stored, for a chat row


@dataclass(frozen=True)
class DataSample:
    path: str
    split: str
    rows_read: int
    windowed: bool  # True: a streamed dataset, sampled from its first STREAM_SAMPLE_WINDOW rows only
    rows: list[SampledRow]


def sample_rows(cfg: RunConfig, count: int, seed: int, which: Literal["train", "eval"] = "train") -> DataSample:
    """``count`` rows of the train (or eval) data drawn at random with ``seed``, rendered for the configured model.

    Raises DatasetError for unreadable or bad rows (as the trainer would at start), and ValueError when ``which``
    is "eval" but no eval_path is set, or ``count`` is below 1.
    """
    if count < 1:
        raise ValueError(f"--rows must be at least 1, not {count}")
    data = cfg.data
    if which == "eval":
        if data.eval_path is None:
            raise ValueError("data.eval_path is not set: there are no eval rows to sample")
        path, split = data.eval_path, data.eval_split
    else:
        path, split = data.train_path, data.split
    windowed = data.streaming and which == "train"
    rows = read_rows(path, data.columns, split, limit=STREAM_SAMPLE_WINDOW if windowed else None)
    chosen = sorted(random.Random(seed).sample(range(len(rows)), min(count, len(rows))))
    tokenizer = load_tokenizer(cfg.model.folder)
    rendered = render_rows([rows[i] for i in chosen], tokenizer)
    return DataSample(
        path=str(path),
        split=split,
        rows_read=len(rows),
        windowed=windowed,
        rows=[
            SampledRow(
                index=index,
                row_id=str(row.get("id", index)),
                prompt=row["prompt"],
                prompt_tokens=len(tokenizer.encode(row["prompt"], add_special_tokens=False)),
                answer=row.get("answer"),
                messages=row.get("messages"),
            )
            for index, row in zip(chosen, rendered, strict=True)
        ],
    )


def format_sample(sample: DataSample) -> str:
    """The sample for a terminal: a header, then each row's id, token count, prompt text and answer."""
    scope = f"first {sample.rows_read} rows (streamed)" if sample.windowed else f"{sample.rows_read} rows"
    lines = [f"{len(sample.rows)} of {scope} of {sample.path} (split {sample.split}), as the model sees them:"]
    for row in sample.rows:
        lines += [
            "",
            f"--- row {row.index} (id {row.row_id}), {row.prompt_tokens} prompt tokens, answer {row.answer!r}",
            row.prompt,
        ]
    return "\n".join(lines)
