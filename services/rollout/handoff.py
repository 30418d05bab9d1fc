"""Tensors handed from the event loop, where they arrive off the wire, to the engine thread, which loads them.

The handoff is bounded in bytes, so a weight sync holds the model plus at most
``max_bytes`` of received tensors (or one tensor, if a single one is larger),
never a second copy of the model. The receiver waits for room on the event loop;
the engine thread blocks on a plain queue, as every engine call must run there.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator
from concurrent.futures import Future

import torch

_END = object()


class EngineGone(RuntimeError):
    """The engine stopped taking tensors (its load failed); its own error says why."""


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class TensorHandoff:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_bytes: int):
        self._loop = loop
        self.max_bytes = max_bytes
        self.waiting = 0  # bytes put and not yet done with by the engine; only the event loop changes it
        self.peak = 0
        self._items: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._room = asyncio.Event()
        self._consumer_done = False

    def watch(self, load: asyncio.Future | Future) -> None:
        """Stop waiting for room once the engine's load has ended (failed: nobody will take more)."""

        def gone(_: object) -> None:
            self._consumer_done = True
            self._room.set()

        load.add_done_callback(gone)

    async def put(self, name: str, tensor: torch.Tensor) -> None:
        size = nbytes(tensor)
        # An empty handoff takes any tensor, however large: otherwise one bigger than max_bytes would never fit.
        while self.waiting and self.waiting + size > self.max_bytes and not self._consumer_done:
            self._room.clear()
            await self._room.wait()
        if self._consumer_done:
            raise EngineGone("the engine stopped loading weights")
        self.waiting += size
        self.peak = max(self.peak, self.waiting)
        self._items.put((name, tensor))

    def close(self, error: BaseException | None = None) -> None:
        """No more tensors; with ``error``, the engine's iterator raises it instead of ending."""
        self._items.put(error if error is not None else _END)

    def _taken(self, size: int) -> None:
        self.waiting -= size
        self._room.set()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Runs on the engine thread."""
        while True:
            item = self._items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            name, tensor = item  # type: ignore[misc]
            yield name, tensor
            # The engine asked for the next one, so it is done with this one (copied into its parameters).
            self._loop.call_soon_threadsafe(self._taken, nbytes(tensor))
            del tensor, item
