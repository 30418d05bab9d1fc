"""The prompt feeder: the dataset walked epoch by epoch in a seeded order, with a cursor a checkpoint keeps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from services.common.model.datasets import Fed, PromptSource, RowTable
from services.common.transport.messages import Prompt


class PromptFeeder:
    """Walks the dataset epoch by epoch in a seeded order; its cursor is (epoch, index), index being how far into
    the epoch's order it is. ``source`` is a list of rows or any ``PromptSource`` (services/common/model/datasets.py:
    rows in memory, a memory-mapped dataset, a stream): the order depends only on the seed and the epoch, so a
    feeder that seeks a saved cursor feeds what the one that saved it would have fed next."""

    def __init__(self, source: list[dict[str, Any]] | PromptSource, seed: int, shuffle: bool):
        self.source = RowTable(source) if isinstance(source, list) else source
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._walk = self.source.walk(0, 0, seed, shuffle)
        # The last prompt, the cursor before it and the walk after it: a seek one prompt back (a publish that
        # failed) replays it instead of reading a stream up to it again.
        self._last: tuple[dict[str, int], Prompt, tuple[int, int, Iterator[Fed]]] | None = None
        self._replay: tuple[Prompt, tuple[int, int, Iterator[Fed]]] | None = None

    def next(self) -> Prompt:
        before = self.cursor
        if self._replay is not None:
            prompt, (self.epoch, self.index, self._walk) = self._replay
            self._replay = None
        else:
            prompt = self._next_row()
        self._last = (before, prompt, (self.epoch, self.index, self._walk))
        return prompt

    def _next_row(self) -> Prompt:
        epochs_ended = 0
        while True:
            fed = next(self._walk, None)
            if fed is None:  # the epoch is over: the next one, in its own order
                epochs_ended += 1
                if epochs_ended > 1:  # a whole epoch went by without a row to feed (streamed rows all bad)
                    raise ValueError("the dataset has no usable row to feed")
                self.epoch, self.index = self.epoch + 1, 0
                self._walk = self.source.walk(self.epoch, 0, self.seed, self.shuffle)
                continue
            self.index = fed.position + 1
            if fed.row is not None:
                break
        return Prompt(
            group_id=f"e{self.epoch}-i{fed.position}",
            prompt_id=str(fed.row.get("id", fed.index)),
            prompt=fed.row["prompt"],
            answer=str(fed.row.get("answer", "")),
            info=fed.row.get("info", {}),
        )

    @property
    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, cursor: dict[str, int]) -> None:
        if self._last is not None and cursor == self._last[0]:
            self._replay = self._last[1:]
        else:
            self._replay = None
            self._walk = self.source.walk(cursor["epoch"], cursor["index"], self.seed, self.shuffle)
        self.epoch, self.index = cursor["epoch"], cursor["index"]
