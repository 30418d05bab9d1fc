"""Prompts rendered with the chat template and tokenized on ``data.tokenize_workers`` processes.

A chat template is Jinja run in Python and a tokenizer call holds the GIL for most of its work, so threads do not
overlap them: parallel preprocessing needs processes. With more than one worker a ``Preprocessor`` keeps a pool of
them, each holding the model's tokenizer (loaded once, when the pool starts); rows go out in chunks of
``CHUNK_ROWS``, spread over the workers, and come back in order. With one worker (the default) everything runs
inline in the caller, as it did before: a pool only pays where the rows per call are many (a held-out set, a
large batch of long chats; docs/performance.md, "Pre-processing").

A role starts the pool off its event loop (``start``, seconds: a loop that renews a lease must not wait on it). The
workers are forked from a fork server (``forkserver``) rather than from the role itself: a role holds gRPC and
torch threads by then, and a fork of a threaded process may inherit a held lock. The fork server imports this
module once, so each worker starts with transformers already imported.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import select
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from services.common.model.chat import prompt_text
from services.common.model.modeling import load_tokenizer
from services.common.parent_death import die_with_parent

CHUNK_ROWS = 128
_worker_tokenizer: PreTrainedTokenizerBase | None = None  # a worker's own, loaded by _start


def _start(model_path: str, role_pid: int) -> None:
    global _worker_tokenizer
    die_with_parent()  # the fork server gone, this worker too
    # ... and the role gone: the fork server outlives it while a worker holds its end of the server's "alive" pipe,
    # and a worker waits for work for ever, so each worker watches the role itself.
    threading.Thread(target=_exit_with, args=(role_pid,), name="exit-with-role", daemon=True).start()
    _worker_tokenizer = load_tokenizer(Path(model_path))


def _exit_with(pid: int) -> None:
    """End this process once ``pid`` has ended: a pidfd turns readable then (Linux 5.3+), else a poll each second."""
    try:
        select.select([os.pidfd_open(pid)], [], [])
    except (AttributeError, OSError):  # no pidfd here; a pid already gone raises too, and the poll ends at once
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(1.0)
    os._exit(0)


def _render(rows: list[dict[str, Any]]) -> list[str]:
    assert _worker_tokenizer is not None
    return [prompt_text(row, _worker_tokenizer) for row in rows]


def _encode(texts: list[str]) -> list[list[int]]:
    assert _worker_tokenizer is not None
    return encode_inline(_worker_tokenizer, texts)


def encode_inline(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """Each text's token ids, as the rollout and evaluation encode a rendered prompt: no special tokens added (a
    rendered chat holds them already)."""
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def _chunks(items: Sequence[Any], size: int = CHUNK_ROWS) -> list[list[Any]]:
    return [list(items[at : at + size]) for at in range(0, len(items), size)]


class Preprocessor:
    """Render and tokenize prompts with ``tokenizer`` inline (``workers`` 1) or on a pool of ``workers``
    processes loading the tokenizer of ``model_path``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model_path: Path, workers: int = 1):
        self.tokenizer = tokenizer
        self.workers = workers
        self.pool: ProcessPoolExecutor | None = None
        if workers > 1:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__])
            self.pool = ProcessPoolExecutor(
                workers, mp_context=context, initializer=_start, initargs=(str(model_path), os.getpid())
            )

    def start(self) -> Preprocessor:
        """Start every worker and wait until each has loaded the tokenizer (the pool starts them on first use
        otherwise): seconds, so a role calls this off its event loop. Returns itself."""
        if self.pool is not None:
            for future in [self.pool.submit(_render, []) for _ in range(self.workers)]:
                future.result()
        return self

    def _spread(self, work: Callable[[list[Any]], list[Any]], items: Sequence[Any], size: int) -> list[Future]:
        assert self.pool is not None
        return [self.pool.submit(work, chunk) for chunk in _chunks(items, size)]

    def _inline(self, items: Sequence[Any]) -> bool:
        return self.pool is None or len(items) <= CHUNK_ROWS

    def render(self, rows: Sequence[dict[str, Any]]) -> list[str]:
        """Each row's prompt text (``chat.prompt_text``); a template that refuses a row raises its
        ChatTemplateError, from a worker as inline."""
        if self._inline(rows):
            return [prompt_text(row, self.tokenizer) for row in rows]
        return [text for future in self._spread(_render, rows, CHUNK_ROWS) for text in future.result()]

    def render_rows(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """New rows whose ``prompt`` is the rendered text (``chat.render_rows``)."""
        return [{**row, "prompt": text} for row, text in zip(rows, self.render(rows), strict=True)]

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        if self._inline(texts):
            return encode_inline(self.tokenizer, texts)
        return [ids for future in self._spread(_encode, texts, CHUNK_ROWS) for ids in future.result()]

    async def encode_async(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` for an event loop: the pool's chunks are awaited, not waited for on the loop."""
        if self._inline(texts):
            return encode_inline(self.tokenizer, texts)
        chunks = await asyncio.gather(*(asyncio.wrap_future(f) for f in self._spread(_encode, texts, CHUNK_ROWS)))
        return [ids for chunk in chunks for ids in chunk]

    def rendered_ahead(self, rows: Iterator[dict[str, Any] | None]) -> Iterator[str | None]:
        """Each row's prompt text in order (None for None) for a walk over a dataset, whose rows come one at a
        time: ``CHUNK_ROWS`` per worker taken at once and spread over every worker."""
        if self.pool is None:
            yield from (None if row is None else prompt_text(row, self.tokenizer) for row in rows)
            return
        while batch := list(itertools.islice(rows, CHUNK_ROWS * self.workers)):
            usable = [row for row in batch if row is not None]
            size = max(1, -(-len(usable) // self.workers))
            texts = iter([text for future in self._spread(_render, usable, size) for text in future.result()])
            yield from (None if row is None else next(texts) for row in batch)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
