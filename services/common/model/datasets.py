"""Prompt/answer datasets: JSON Lines or local Hugging Face datasets, and the tiny tasks' own builders.

Every row is a JSON object with an ``answer`` string and either a plain ``prompt`` string,
e.g. ``{"id": "add-0037-0045", "prompt": "37+45=", "answer": "82"}``, or ``messages``, a chat
rendered with the model's chat template (services/common/model/chat.py), e.g.
``{"id": "word-0-tom-apples-017-025", "messages": [{"role": "user", "content": "Tom has 17 apples and buys
25 more. How many apples does Tom have now?"}], "answer": "42"}``.

The same rows may come from a local Hugging Face dataset (a ``save_to_disk`` folder, Parquet, Arrow,
JSON or CSV) whose columns ``data.columns`` names, read whole (memory-mapped) or streamed. The
trainer's feeder walks them through a ``PromptSource``: an epoch's order depends only on the seed
and the epoch, so a cursor (epoch, index) saved in a checkpoint resumes the same sequence (docs/data.md).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from services.common.config import DataColumns, DataConfig
from services.common.observe.events import Event
from services.common.observe.logs import log_event

log = logging.getLogger(__name__)

# "tool": a worked tool exchange in a row's chat (docs/agents.md recommends one with observation_role: tool); the
# chat template must take it, which rendering checks (chat.py).
CHAT_ROLES = ("system", "user", "assistant", "tool")


def row_problem(raw: bytes) -> str | None:
    """Why one JSON Lines line is not a prompt/answer row (under the default column names), or None when it is one."""
    try:
        prompt_row(_jsonl_record(raw), DataColumns())
    except BadRow as error:
        return str(error)
    return None


def messages_problem(messages: object) -> str | None:
    """Why ``messages`` is not a chat to render with ``add_generation_prompt=True``, or None when it is one."""
    if not isinstance(messages, list) or not messages:
        return "field 'messages' must be a non-empty list of {role, content} objects"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is not a JSON object"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f"messages[{i}].{key} is missing or not a string"
        if message["role"] not in CHAT_ROLES:
            return f"messages[{i}].role {message['role']!r} is not one of {list(CHAT_ROLES)}"
    # The generation prompt opens a new assistant turn; after an assistant turn that would be a second one.
    if messages[-1]["role"] == "assistant":
        return f"messages[{len(messages) - 1}].role is 'assistant'; the last message is what the model answers"
    return None


def load_jsonl(path: Path) -> list[dict]:
    """Read prompt/answer rows from a JSON Lines file, skipping blank lines.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file, the 1-based line number and the field of the first
            line that is not a row (see ``row_problem``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")

    rows = []
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            problem = row_problem(line)
            if problem is not None:
                raise ValueError(f"{path}:{line_number}: {problem}")
            rows.append(json.loads(line))
    return rows


# -- Any source: JSON Lines, or a local Hugging Face dataset, as rows the trainer can feed -----------------------

JSONL_SUFFIXES = (".jsonl",)
# A file datasets reads with one of its packaged builders, by suffix.
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".csv": "csv"}
SHOWN_BAD_ROWS = 5


class DatasetError(ValueError):
    """A dataset the run cannot use: missing columns, a split it lacks, or rows that are not prompt/answer rows."""


class BadRow(ValueError):
    """One record that is not a prompt/answer row; the message says why."""


def prompt_row(record: Mapping[str, Any], columns: DataColumns) -> dict[str, Any]:
    """The row ``record`` holds, under rlpipe's own names (``prompt`` or ``messages``, ``answer``, ``id``).

    Raises BadRow naming the column and what is wrong with it.
    """
    answer = record.get(columns.answer)
    if not isinstance(answer, str):
        raise BadRow(f"missing or non-string field {columns.answer!r}")
    row: dict[str, Any] = {"answer": answer}
    if record.get(columns.id) is not None:
        row["id"] = str(record[columns.id])
    if record.get(columns.info) is not None:
        info = json_object(record[columns.info])
        if info is not None:
            row["info"] = info
        elif "info" in columns.model_fields_set:  # named for the environment: a value it cannot take is the row's fault
            raise BadRow(f"field {columns.info!r} must be a JSON object (what the row's environment needs)")
        # A column that merely happens to be called "info" holds something else: no environment's, left out.
    has_messages = record.get(columns.messages) is not None
    if has_messages and record.get(columns.prompt) is not None:
        raise BadRow(f"has both {columns.prompt!r} and {columns.messages!r}; give one")
    if has_messages:
        messages = record[columns.messages]
        problem = messages_problem(messages)
        if problem is not None:
            raise BadRow(problem.replace("'messages'", repr(columns.messages)))
        row["messages"] = [{"role": m["role"], "content": m["content"]} for m in messages]
        return row
    if not isinstance(record.get(columns.prompt), str):
        raise BadRow(f"missing or non-string field {columns.prompt!r} (or give {columns.messages!r})")
    row["prompt"] = record[columns.prompt]
    return row


def json_object(value: Any) -> dict[str, Any] | None:
    """``value`` as a JSON object of plain values (a dict, or text holding one, as a CSV cell does); None when it is
    not one (another type, or values JSON cannot hold, such as a timestamp)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict):
        return None
    try:
        return json.loads(json.dumps(value))  # plain values only: what a message and an HTTP body carry
    except (TypeError, ValueError):
        return None


def _jsonl_record(raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRow("not UTF-8") from None
    except json.JSONDecodeError as err:
        raise BadRow(f"invalid JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise BadRow("not a JSON object")
    return record


def is_jsonl(path: Path) -> bool:
    return path.is_file() and path.suffix in JSONL_SUFFIXES


def _jsonl_records(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of every non-blank line, read as it goes."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield number, line


def hf_dataset(path: Path, split: str, streaming: bool) -> Any:
    """``path`` as a ``datasets`` Dataset (memory-mapped Arrow) or, with ``streaming``, an IterableDataset.

    A save_to_disk folder is loaded from disk; a Parquet/Arrow/JSON/CSV file or a folder of them with
    datasets' packaged builders. Of several splits, ``split`` is taken; of one, that one.
    """
    import datasets

    datasets.logging.set_verbosity_error()  # its progress bars would fill the trainer's log
    datasets.disable_progress_bars()
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        loaded = datasets.load_from_disk(str(path))
    elif path.is_file():
        builder = BUILDERS.get(path.suffix)
        if builder is None:
            raise DatasetError(
                f"{path}: cannot tell the format from {path.suffix!r}; use .jsonl, {', '.join(BUILDERS)} "
                "or a save_to_disk folder"
            )
        loaded = datasets.load_dataset(builder, data_files={"train": str(path)}, streaming=streaming)
    else:
        try:
            loaded = datasets.load_dataset(str(path), streaming=streaming)
        except (FileNotFoundError, ValueError) as error:
            raise DatasetError(f"{path}: not a dataset folder datasets can read ({error})") from None
    if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in loaded and len(loaded) != 1:
            raise DatasetError(f"{path}: has no split {split!r} (it has {sorted(loaded)}); set data.split")
        loaded = loaded[split] if split in loaded else next(iter(loaded.values()))
    if streaming and isinstance(loaded, datasets.Dataset):
        loaded = loaded.to_iterable_dataset()
    return loaded


def _check_columns(path: Path, names: list[str] | None, columns: DataColumns) -> None:
    """A dataset without the answer column, or without both a prompt and a messages column, names what it has."""
    if names is None:  # a stream whose columns show only in its rows
        return
    if columns.answer not in names:
        raise DatasetError(f"{path}: no column {columns.answer!r} (data.columns.answer); it has {names}")
    if columns.prompt not in names and columns.messages not in names:
        raise DatasetError(
            f"{path}: no column {columns.prompt!r} (data.columns.prompt) or {columns.messages!r} "
            f"(data.columns.messages); it has {names}"
        )


@dataclass
class DataScan:
    """What checking a dataset's rows found: ``bad`` holds (where, reason), where being a line or row number."""

    where: str  # "line" (JSON Lines, 1-based) or "row" (a dataset's 0-based index)
    rows: int = 0
    checked: int = 0
    truncated: bool = False
    # The first row of each set of roles among the chat rows: each is rendered at start, so a template that does not
    # take a role (a worked ``tool`` exchange) is refused before the run, not when the feeder reaches that row.
    chats_by_roles: dict[tuple[str, ...], dict[str, Any]] = field(default_factory=dict)
    bad: list[tuple[int, str]] = field(default_factory=list)

    def summary(self, path: Path) -> str:
        shown = "; ".join(f"{self.where} {at}: {reason}" for at, reason in self.bad[:SHOWN_BAD_ROWS])
        more = f"; and {len(self.bad) - SHOWN_BAD_ROWS} more" if len(self.bad) > SHOWN_BAD_ROWS else ""
        scope = f"first {self.checked} {self.where}s" if self.truncated else f"{self.checked} {self.where}s"
        return f"{path}: {len(self.bad)} bad of {scope}: {shown}{more}"


def _records(path: Path, split: str, streaming: bool, columns: DataColumns) -> tuple[str, Iterator[tuple[int, Any]]]:
    """("line", (line number, raw line)) of a JSON Lines file, or ("row", (index, record)) of a dataset."""
    if is_jsonl(path):
        return "line", _jsonl_records(path)
    dataset = hf_dataset(path, split, streaming)
    _check_columns(path, None if dataset.column_names is None else list(dataset.column_names), columns)
    return "row", enumerate(dataset)


def _to_row(where: str, record: Any, columns: DataColumns) -> dict[str, Any]:
    return prompt_row(_jsonl_record(record) if where == "line" else record, columns)


def scan_dataset(
    path: Path, columns: DataColumns, split: str = "train", limit: int | None = None, streaming: bool = False
) -> DataScan:
    """Check the first ``limit`` rows (all with None) of the dataset at ``path``, reading them as they come.

    Raises DatasetError for what is wrong with the whole dataset (format, split, columns).
    """
    where, records = _records(path, split, streaming, columns)
    scan = DataScan(where)
    for at, record in records:
        # Lines count blank ones too, as an editor numbers them.
        checked = at if where == "line" else scan.checked + 1
        if limit is not None and checked > limit:
            scan.truncated = True
            break
        scan.checked = checked
        try:
            row = _to_row(where, record, columns)
        except BadRow as error:
            scan.bad.append((at, str(error)))
            continue
        scan.rows += 1
        if "messages" in row:
            scan.chats_by_roles.setdefault(tuple(sorted({m["role"] for m in row["messages"]})), row)
    return scan


def read_rows(path: Path, columns: DataColumns, split: str = "train", limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` rows (all with None) of the dataset at ``path``; DatasetError listing bad ones."""
    where, records = _records(path, split, False, columns)
    rows, bad = [], DataScan(where)
    for at, record in itertools.islice(records, limit):
        bad.checked += 1
        try:
            rows.append(_to_row(where, record, columns))
        except BadRow as error:
            bad.bad.append((at, str(error)))
    if bad.bad:
        raise DatasetError(bad.summary(path))
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


Render = Callable[[dict[str, Any]], str]
# Rows in, their prompt texts out in the same order (None for None): a renderer that works ahead of the walk
# (``preprocess.Preprocessor.rendered_ahead``, on data.tokenize_workers processes).
RenderAhead = Callable[[Iterator[dict[str, Any] | None]], Iterator[str | None]]


@dataclass
class Fed:
    """One row in an epoch's order: ``position`` in that order, ``index`` in the dataset, the row with its
    prompt rendered (None: a streamed row that is not usable, already logged)."""

    position: int
    index: int
    row: dict[str, Any] | None


class PromptSource(Protocol):
    """Rows in a seeded order per epoch, from any place in it: what the trainer's feeder walks."""

    def walk(self, epoch: int, start: int, seed: int, shuffle: bool) -> Iterator[Fed]: ...


class RowTable:
    """Rows with random access (a list in memory, or a memory-mapped Dataset): an epoch is a seeded permutation."""

    def __init__(
        self, rows: Sequence[Any], to_row: Callable[[Any], dict[str, Any]] = dict, render: Render | None = None
    ):
        self.rows = rows
        self.to_row = to_row
        self.render = render

    def walk(self, epoch: int, start: int, seed: int, shuffle: bool) -> Iterator[Fed]:
        order = np.random.default_rng([seed, epoch]).permutation(len(self.rows)) if shuffle else None
        for position in range(start, len(self.rows)):
            index = int(order[position]) if order is not None else position
            row = self.to_row(self.rows[index])
            if self.render is not None:
                row = {**row, "prompt": self.render(row)}
            yield Fed(position, index, row)


class RowStream:
    """A streamed dataset, never held whole: an epoch is datasets' seeded buffer shuffle of it, and a walk
    from ``start`` reads the ``start`` rows before it again (the same ones: the order depends only on the
    seed and the epoch)."""

    def __init__(self, dataset: Any, where: str, columns: DataColumns, buffer: int, render: Render | None = None):
        self.dataset = dataset
        self.where = where
        self.columns = columns
        self.buffer = buffer
        self.render = render

    def walk(self, epoch: int, start: int, seed: int, shuffle: bool) -> Iterator[Fed]:
        dataset = self.dataset
        if shuffle:
            dataset = dataset.shuffle(seed=seed, buffer_size=self.buffer)
            dataset.set_epoch(epoch)
        for position, item in enumerate(itertools.islice(dataset, start, None), start=start):
            index, record = item["__index__"], item["__record__"]
            try:
                row = _to_row(self.where, record, self.columns)
            except BadRow as error:
                log_event(
                    log, Event.DATA_ROW_SKIPPED, level=logging.WARNING, where=f"{self.where} {index}", error=str(error)
                )
                yield Fed(position, index, None)
                continue
            if self.render is not None:
                row = {**row, "prompt": self.render(row)}
            yield Fed(position, index, row)


def _stream(path: Path, data: DataConfig) -> RowStream:
    """``path`` as a stream of {__index__, __record__} items, so JSON Lines and datasets shuffle alike."""
    import datasets

    if is_jsonl(path):

        def lines(path: str) -> Iterator[dict[str, Any]]:
            for number, line in _jsonl_records(Path(path)):
                yield {"__index__": number, "__record__": line}

        stream = datasets.IterableDataset.from_generator(lines, gen_kwargs={"path": str(path)})
        return RowStream(stream, "line", data.columns, data.shuffle_buffer)
    dataset = hf_dataset(path, data.split, streaming=True)
    names = None if dataset.column_names is None else list(dataset.column_names)
    _check_columns(path, names, data.columns)
    indexed = dataset.map(
        lambda record, index: {"__index__": index, "__record__": record},
        with_indices=True,
        remove_columns=names,
    )
    return RowStream(indexed, "row", data.columns, data.shuffle_buffer)


class RenderedAhead:
    """A source whose rows' prompts ``ahead`` renders, a stretch of rows ahead of the walk."""

    def __init__(self, source: PromptSource, ahead: RenderAhead):
        self.source = source
        self.ahead = ahead

    def walk(self, epoch: int, start: int, seed: int, shuffle: bool) -> Iterator[Fed]:
        feds, rows = itertools.tee(self.source.walk(epoch, start, seed, shuffle))
        texts = self.ahead(fed.row for fed in rows)
        for fed, text in zip(feds, texts, strict=True):
            yield Fed(fed.position, fed.index, None if fed.row is None else {**fed.row, "prompt": text})


def open_prompts(
    data: DataConfig,
    render: Render | None = None,
    check_rows: int = 1_000,
    render_ahead: RenderAhead | None = None,
) -> PromptSource:
    """The training rows of ``data`` for the feeder, each prompt rendered by ``render`` when given, or by
    ``render_ahead`` (rows rendered ahead of the walk; ``render`` then only checks the chats at start).

    Checked at start: every row of a JSON Lines file or a dataset read whole; the first ``check_rows`` of
    a stream (later bad ones are skipped and logged). DatasetError lists the bad rows by line or index.
    One chat row of each set of roles is rendered here, so a model without a chat template, or one whose template
    does not take a row's roles, is refused now, not mid-run.
    """
    path = data.train_path
    scan = scan_dataset(path, data.columns, data.split, check_rows if data.streaming else None, data.streaming)
    if scan.bad:
        raise DatasetError(scan.summary(path))
    if scan.rows == 0:
        raise DatasetError(f"{path}: no rows")
    if data.streaming:
        source: RowTable | RowStream = _stream(path, data)
    elif is_jsonl(path):
        source = RowTable([_to_row("line", raw, data.columns) for _, raw in _jsonl_records(path)])
    else:
        dataset = hf_dataset(path, data.split, streaming=False)
        source = RowTable(dataset, lambda record: prompt_row(record, data.columns))
    if render is not None:
        for chat in scan.chats_by_roles.values():
            render(chat)  # a template missing, or refusing a role, raises ChatTemplateError now, not mid-run
    if render_ahead is not None:
        return RenderedAhead(source, render_ahead)
    source.render = render
    return source
