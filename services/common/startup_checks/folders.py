"""The model folders and datasets a run reads: they load, fit together and parse, checked without loading a
model."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.config import DataConfig, RunConfig
from services.common.model.datasets import DatasetError, scan_dataset
from services.common.startup_checks.rows import CheckResult, human_size, shorten
from services.common.transport.model_source import local_model_path


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))


def check_model(path: Path, name: str = "model") -> CheckResult:
    """The folder loads as a Hugging Face causal LM would.

    That is: a config, a real tokenizer that fits the embeddings, and weights. Read without transformers' Auto
    classes where the folder allows it: they import torch and every model family's code, 5 to 7 CPU s that a
    launcher or `rlpipe doctor` would spend before anything starts. The config is its JSON; the tokenizer is
    counted by ``_vocabulary``.
    """
    if not path.is_dir():
        return CheckResult(name, "fail", f"{path}: no such folder")
    try:
        config = json.loads((path / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError(f"config.json holds a {type(config).__name__}, not an object")
    except (OSError, ValueError) as error:
        return CheckResult(name, "fail", f"{path}: config does not load: {shorten(error)}")
    # transformers raises OSError, ValueError, KeyError... depending on what is wrong with the folder.
    try:
        vocab, special = _vocabulary(path)
    except Exception as error:
        return CheckResult(name, "fail", f"{path}: tokenizer does not load: {shorten(error)}")
    # Without tokenizer files transformers builds an empty tokenizer holding only special tokens.
    if vocab <= special:
        return CheckResult(
            name, "fail", f"{path}: the tokenizer is empty ({vocab} tokens): tokenizer files are missing"
        )
    embeddings = config.get("vocab_size")
    if embeddings is not None and vocab > embeddings:
        return CheckResult(
            name, "fail", f"{path}: the tokenizer has {vocab} tokens but the model embeds only {embeddings}"
        )
    weights = weight_files(path)
    if not weights:
        return CheckResult(name, "fail", f"{path}: no weights (*.safetensors or pytorch_model*.bin)")
    size = sum(p.stat().st_size for p in weights)
    kind = config.get("model_type", "unknown type")
    return CheckResult(name, "ok", f"{path}: {kind}, {vocab} tokens, weights {human_size(size)}")


def _vocabulary(path: Path) -> tuple[int, int]:
    """The tokenizer's size and how many of its tokens are special. A tokenizer.json is read by the tokenizers
    library alone (0.05 CPU s, against 2 for transformers' fast tokenizer class, which wraps the same object and
    counts it the same way); a folder without one goes through AutoTokenizer."""
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        special = sum(token.special for token in tokenizer.get_added_tokens_decoder().values())
        return tokenizer.get_vocab_size(with_added_tokens=True), special
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(path))
    return len(auto), len(auto.all_special_tokens)


def check_dataset(data: DataConfig, path: Path, split: str, name: str, max_rows: int) -> CheckResult:
    """The first ``max_rows`` rows (lines of a JSON Lines file) are prompt/answer rows; bad ones are listed by line
    number or row index."""
    try:
        # Streamed: a check reads the rows it checks, not the whole dataset.
        scan = scan_dataset(path, data.columns, split, max_rows, streaming=True)
    except OSError as error:
        return CheckResult(name, "fail", f"{path}: cannot read: {shorten(error)}")
    except Exception as error:  # a bad format, split or column, or whatever datasets or pyarrow could not read
        return CheckResult(name, "fail", shorten(error) if isinstance(error, DatasetError) else f"{path}: {error}")
    if scan.bad:
        return CheckResult(name, "fail", scan.summary(path))
    if scan.rows == 0:
        return CheckResult(name, "fail", f"{path}: no rows")
    scope = f"first {scan.checked} {scan.where}s" if scan.truncated else f"{scan.checked} {scan.where}s"
    return CheckResult(name, "ok", f"{path}: {scan.rows} rows parse ({scope} checked)")


def model_rows(cfg: RunConfig, policy: bool, reference: bool) -> list[CheckResult]:
    """The policy's (and the reference's) model folder as ``check_model`` sees it. A model.path URL is checked
    where it was fetched to; one not fetched yet gets a warning (the roles fetch it at start: resolve_model)."""
    local = local_model_path(cfg.model)
    if local is None:
        policy_row = CheckResult(
            "model",
            "warn",
            f"{cfg.model.path}: not fetched yet; the first start fetches it into {cfg.model.fetch.cache_dir}",
        )
    else:
        policy_row = check_model(local)
    rows = [policy_row] if policy else []
    if reference and cfg.reference.model_path is not None and (not policy or cfg.reference.model_path != local):
        rows.append(check_model(cfg.reference.model_path, "reference model"))
    elif reference and not policy:
        rows.append(CheckResult("reference model", policy_row.status, policy_row.detail))
    return rows


def dataset_rows(data: DataConfig, max_lines: int) -> list[CheckResult]:
    sources = {
        "dataset data.train_path": (data.train_path, data.split),
        "dataset data.eval_path": (data.eval_path, data.eval_split),
    }
    return [check_dataset(data, path, split, name, max_lines) for name, (path, split) in sources.items() if path]
