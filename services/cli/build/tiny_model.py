"""Build a tiny, partly trained Qwen2 arithmetic model as a Hugging Face folder.

The folder (safetensors weights, config, generation config, tokenizer files)
loads through the ordinary ``transformers`` and ``vllm`` code paths, so RL
services can use it exactly like a real checkpoint. A short supervised warm
start leaves the model only partly right, which gives RL room to improve it.

CLI::

    python -m services.cli.build.tiny_model --out models/tiny-arith --data data/arith --seed 0
    python -m services.cli.build.tiny_model --task word-problems --data data/word-problems
"""

from __future__ import annotations

import argparse
import json
import string
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from tokenizers import pre_tokenizers
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from services.cli.build.tasks import (
    TOOL_SHARE,
    make_arithmetic_dataset,
    make_tool_arith_dataset,
    make_word_problem_dataset,
)
from services.common.model.datasets import load_jsonl
from services.common.model.evaluation import greedy_accuracy
from services.common.model.padding import eos_token_id, pad_token_id

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
ALPHABET = string.digits + "+-*=" + " " + string.ascii_lowercase
MAX_POSITIONS = 64
# The tool model (--task tool-arith) also spells the calculator's tags, and its transcripts are longer.
TOOL_ALPHABET = ALPHABET + "<>/"
TOOL_MAX_POSITIONS = 96
# Its warm start learns the tool's format, not the products (dev accuracy on whole transcripts stays near 0), so it
# runs a fixed number of steps: 800 at TOOL_SHARE, where a quarter of the transcripts teach the format (400 did with
# every transcript calling the tool).
TOOL_WARM_START_STEPS = 800

# Tuned on 2 shared CPU cores: dev accuracy climbs through 30-60% around step
# 300 (about 30 s), gradually enough for a 10-step check to stop near the target.
LEARNING_RATE = 3e-4
BATCH_SIZE = 128
EVAL_EVERY_STEPS = 10
DEFAULT_MAX_STEPS = 1500
# Two OpenMP threads on cores shared with other processes spin-wait and ran
# ~30x slower in practice; one thread also keeps results independent of the host.
TORCH_THREADS = 1

BUILD_MARKER = "tiny_model_build.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def build_char_tokenizer(alphabet: str = ALPHABET, max_positions: int = MAX_POSITIONS) -> Qwen2Tokenizer:
    """Character-level tokenizer: one token per ``ALPHABET`` character, ``<pad>`` = 0, no BOS.

    It is a Qwen2 byte-level BPE with a character vocabulary and no merges, not a
    generic ``PreTrainedTokenizerFast``: for ``model_type == "qwen2"``,
    ``AutoTokenizer`` (and therefore vLLM) always rebuilds the Qwen2 pipeline from
    the saved vocabulary and ignores any other pipeline in tokenizer.json.
    Characters outside ``alphabet`` have no token and are dropped when encoding.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    for char in alphabet:
        # Byte-level BPE spells some characters differently, e.g. space as "Ġ".
        [(byte_level_char, _)] = byte_level.pre_tokenize_str(char)
        vocab[byte_level_char] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        # Qwen2Tokenizer would otherwise add "<|endoftext|>", growing the vocabulary (transformers annotates a str,
        # and takes None for no unknown token).
        unk_token=None,  # pyright: ignore[reportArgumentType]
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=max_positions,
    )


def _new_model(tokenizer: Qwen2Tokenizer, seed: int, max_positions: int = MAX_POSITIONS) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_token_id(tokenizer),
        pad_token_id=pad_token_id(tokenizer),  # its PAD_TOKEN
        dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        do_sample=False,
        eos_token_id=eos_token_id(tokenizer),
        pad_token_id=pad_token_id(tokenizer),  # its PAD_TOKEN
    )
    return model


def _encode_examples(tokenizer: Qwen2Tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Token ids of ``prompt + answer + <eos>`` and labels that score only answer and EOS."""
    examples = []
    for row in rows:
        prompt_ids = tokenizer.encode(row["prompt"], add_special_tokens=False)
        answer_ids = tokenizer.encode(row["answer"], add_special_tokens=False)
        target_ids = [*answer_ids, tokenizer.eos_token_id]
        examples.append((prompt_ids + target_ids, [-100] * len(prompt_ids) + target_ids))
    return examples


def _collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids, labels, attention_mask = [], [], []
    for ids, target in examples:
        padding = width - len(ids)
        input_ids.append(ids + [pad_id] * padding)
        labels.append(target + [-100] * padding)
        attention_mask.append([1] * len(ids) + [0] * padding)
    return {
        "input_ids": torch.tensor(input_ids),
        "labels": torch.tensor(labels),
        "attention_mask": torch.tensor(attention_mask),
    }


def _max_answer_tokens(tokenizer: Qwen2Tokenizer, rows: list[dict]) -> int:
    # One extra token so a complete answer can end with EOS.
    return max(len(tokenizer.encode(row["answer"], add_special_tokens=False)) for row in rows) + 1


def _warm_start(
    model: Qwen2ForCausalLM,
    tokenizer: Qwen2Tokenizer,
    train_rows: list[dict],
    dev_rows: list[dict],
    seed: int,
    target_accuracy: float,
    max_steps: int,
) -> tuple[int, float]:
    """Train on answers until greedy dev accuracy reaches the target.

    Returns the number of optimizer steps taken and the last dev accuracy.
    """
    examples = _encode_examples(tokenizer, train_rows)
    max_new_tokens = _max_answer_tokens(tokenizer, dev_rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    order_generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    dev_accuracy = 0.0
    step = 0
    model.train()

    progress = Progress(
        TextColumn("[bold]warm start"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}  dev acc {task.fields[dev_accuracy]:.3f}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
    with progress:
        task = progress.add_task("sft", total=max_steps, loss=float("nan"), dev_accuracy=dev_accuracy)
        while step < max_steps:
            if len(order) < BATCH_SIZE:
                order += torch.randperm(len(examples), generator=order_generator).tolist()
            batch_indices, order = order[:BATCH_SIZE], order[BATCH_SIZE:]
            batch = _collate([examples[i] for i in batch_indices], pad_token_id(tokenizer))

            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1

            evaluate_now = step % EVAL_EVERY_STEPS == 0 or step == max_steps
            if evaluate_now:
                dev_accuracy = greedy_accuracy(model, tokenizer, dev_rows, max_new_tokens)
            progress.update(task, advance=1, loss=loss.item(), dev_accuracy=dev_accuracy)
            if evaluate_now and dev_accuracy >= target_accuracy:
                break
    model.eval()
    return step, dev_accuracy


def _build_settings(seed: int, target_accuracy: float, max_steps: int, task: str, tool_share: float) -> dict:
    """Everything that determines the built weights; a folder is reused only if these match."""
    return {
        **({"task": task} if task != "arithmetic" else {}),  # the arithmetic model's markers predate tasks
        **({"tool_share": tool_share} if task == "tool-arith" else {}),
        "seed": seed,
        "target_accuracy": target_accuracy,
        "max_steps": max_steps,
        "learning_rate": LEARNING_RATE,
        "batch_size": BATCH_SIZE,
        "eval_every_steps": EVAL_EVERY_STEPS,
    }


def _reusable_summary(out_dir: Path, settings: dict) -> dict | None:
    marker = out_dir / BUILD_MARKER
    if not marker.is_file() or not all((out_dir / name).is_file() for name in MODEL_FILES):
        return None
    try:
        recorded = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return None
    if recorded.get("settings") != settings:
        return None
    return recorded["summary"]


def build_tiny_model(
    out_dir: Path,
    data_dir: Path,
    seed: int = 0,
    target_accuracy: float = 0.4,
    max_steps: int = DEFAULT_MAX_STEPS,
    task: str = "arithmetic",
    tool_share: float = TOOL_SHARE,
) -> dict:
    """Write a warm-started tiny Qwen2 model and its tokenizer to ``out_dir``.

    ``data_dir`` must hold ``train.jsonl``, ``dev.jsonl`` and ``eval.jsonl``
    (see ``make_arithmetic_dataset``). Training stops as soon as greedy dev
    accuracy reaches ``target_accuracy`` or after ``max_steps`` steps.

    If ``out_dir`` already holds a complete model built with the same settings,
    nothing is trained and the recorded summary is returned with ``reused=True``.

    Returns a summary with ``steps``, ``dev_accuracy``, ``eval_accuracy``,
    ``seconds`` and ``reused``.

    ``task="tool-arith"``: the rows' ``transcript`` (a calculator call, its result, the answer) is what the model
    learns, with the calculator's tags in its vocabulary (see ``make_tool_arith_dataset``); ``tool_share`` is the
    share of those transcripts that call the tool, as the dataset in ``data_dir`` was written with it.
    """
    out_dir, data_dir = Path(out_dir), Path(data_dir)
    settings = _build_settings(seed, target_accuracy, max_steps, task, tool_share)
    summary = _reusable_summary(out_dir, settings)
    if summary is not None:
        return {**summary, "reused": True}

    started = time.perf_counter()
    train_rows = load_jsonl(data_dir / "train.jsonl")
    dev_rows = load_jsonl(data_dir / "dev.jsonl")
    eval_rows = load_jsonl(data_dir / "eval.jsonl")

    if task == "tool-arith":
        train_rows, dev_rows = (
            [{**row, "answer": row["transcript"]} for row in rows] for rows in (train_rows, dev_rows)
        )
        tokenizer = build_char_tokenizer(TOOL_ALPHABET, TOOL_MAX_POSITIONS)
        model = _new_model(tokenizer, seed, TOOL_MAX_POSITIONS)
    else:
        tokenizer = build_char_tokenizer()
        model = _new_model(tokenizer, seed)
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        steps, dev_accuracy = _warm_start(model, tokenizer, train_rows, dev_rows, seed, target_accuracy, max_steps)
        eval_accuracy = greedy_accuracy(model, tokenizer, eval_rows, _max_answer_tokens(tokenizer, eval_rows))
    finally:
        torch.set_num_threads(caller_threads)

    out_dir.mkdir(parents=True, exist_ok=True)
    # Drop a stale marker first so an interrupted rebuild is never mistaken for complete.
    (out_dir / BUILD_MARKER).unlink(missing_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    summary = {
        "steps": steps,
        "dev_accuracy": dev_accuracy,
        "eval_accuracy": eval_accuracy,
        "seconds": round(time.perf_counter() - started, 2),
    }
    marker = {"settings": settings, "summary": summary}
    (out_dir / BUILD_MARKER).write_text(json.dumps(marker, indent=2))
    return {**summary, "reused": False}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="model folder to write (arithmetic only)")
    parser.add_argument("--data", type=Path, required=True, help="folder for the JSONL splits")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-accuracy", type=float, default=0.4)
    parser.add_argument(
        "--max-steps",
        type=int,
        help=f"warm-start steps at most (default {DEFAULT_MAX_STEPS}; tool-arith: exactly, default "
        f"{TOOL_WARM_START_STEPS})",
    )
    parser.add_argument(
        "--task",
        choices=("arithmetic", "word-problems", "tool-arith"),
        default="arithmetic",
        help="word-problems writes only the chat-form dataset: the character-level model cannot read a chat; "
        "tool-arith: multiplications and a model warm-started on calculator transcripts (examples/tool-arith.yaml)",
    )
    parser.add_argument(
        "--tool-share",
        type=float,
        default=TOOL_SHARE,
        help="tool-arith: the share of warm-start transcripts that call the calculator (the others state the "
        f"product outright; default {TOOL_SHARE}: a model that seldom calls it at first and has to learn to)",
    )
    args = parser.parse_args(argv)

    if args.task == "word-problems":
        paths = make_word_problem_dataset(args.data, seed=args.seed)
        print(json.dumps({split: str(path) for split, path in paths.items()}))
        return
    if args.out is None:
        parser.error(f"--out is required with --task {args.task}")
    if args.task == "tool-arith":
        make_tool_arith_dataset(args.data, seed=args.seed, tool_share=args.tool_share)
        summary = build_tiny_model(
            args.out,
            args.data,
            seed=args.seed,
            target_accuracy=1.0,
            max_steps=args.max_steps or TOOL_WARM_START_STEPS,
            task=args.task,
            tool_share=args.tool_share,
        )
        print(json.dumps(summary))
        return
    make_arithmetic_dataset(args.data, seed=args.seed)
    summary = build_tiny_model(
        args.out,
        args.data,
        seed=args.seed,
        target_accuracy=args.target_accuracy,
        max_steps=args.max_steps or DEFAULT_MAX_STEPS,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
