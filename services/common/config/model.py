"""The model and data sections: the policy model, its LoRA adapters, and the prompts to train and evaluate on."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from services.common.config.base import Section


class LoraConfig(Section):
    """LoRA adapters on the policy (peft): only they train, have optimizer state, sync and are checkpointed."""

    r: int = Field(16, gt=0, description="rank of each adapter: the inner dimension of its A and B matrices (> 0)")
    alpha: float = Field(
        32.0, gt=0, description="scale numerator (> 0): an adapter's update B @ A is multiplied by alpha / r"
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="dropout probability on each adapter's input while training (0 to <1)"
    )
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="names of the Linear modules that get an adapter (the last part of a module's path, e.g. "
        "q_proj); each must name one of the model's Linear modules, or the trainer refuses to start listing them",
    )


class ModelConfig(Section):
    path: Path = Field(description="Hugging Face model folder (config.json, weights, tokenizer)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="weights and activations of rollout, reference and evaluation, and the trainer's compute dtype "
        "(its parameters stay float32 by default: train.master_weights). float16 is refused: the trainer has no loss "
        "scaling, so its small gradients would underflow to zero",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where the trainer, critic, reference and evaluation run: auto = CUDA when this process sees a "
        "GPU, else CPU; cuda without a GPU stops the service at start",
    )
    lora: LoraConfig | None = Field(
        None,
        description="train LoRA adapters instead of every weight (None = full weights); the reference and the "
        "rollout keep the base model at path",
    )

    @field_validator("path")
    @classmethod
    def _folder_with_config(cls, path: Path) -> Path:
        if not path.is_dir():
            raise ValueError(f"model folder {str(path)!r} does not exist")
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json")
        return path


class DataColumns(Section):
    """Which of a dataset's columns hold what a row needs (docs/configuration.md, data.columns)."""

    prompt: str = Field("prompt", min_length=1, description="the plain prompt text")
    messages: str = Field(
        "messages", min_length=1, description="a chat ([{role, content}, ...]) rendered with the chat template"
    )
    answer: str = Field("answer", min_length=1, description="the reference answer the reward compares with")
    id: str = Field("id", min_length=1, description="a row's stable id (optional; the row's index otherwise)")
    info: str = Field(
        "info",
        min_length=1,
        description="a JSON object (or text holding one) with what the row's environment needs (test cases, a "
        "game's seed), given to its reset as Task.info (optional; multi-turn runs, docs/agents.md). Under the "
        "default name a value that is not one is left out; under a name you set it is a bad row",
    )


class DataConfig(Section):
    task_name: str = Field(
        "arithmetic",
        description="a label for what the data asks (arithmetic, word-problems, ...): kept with the config and in the "
        "run's records; which rows are read is train_path's, how they are scored reward.functions'",
    )
    train_path: Path = Field(
        description="JSON Lines file, or a local Hugging Face dataset: a save_to_disk folder, a Parquet, Arrow, "
        "JSON or CSV file, or a folder of them"
    )
    eval_path: Path | None = Field(None, description="held-out rows, in any form train_path takes")
    split: str = Field("train", min_length=1, description="the split of train_path to train on, when it holds several")
    eval_split: str = Field(
        "test", min_length=1, description="the split of eval_path to evaluate on, when it holds several"
    )
    columns: DataColumns = Field(DataColumns(), description="which dataset columns hold a row's parts (names)")
    streaming: bool = Field(
        False,
        description="read train_path as a stream instead of all at once, for datasets larger than memory: rows are "
        "checked as they come (a bad one is skipped and logged) and a resume reads up to its place again",
    )
    shuffle_buffer: int = Field(
        10_000, ge=1, description="rows a streamed dataset is shuffled within (a full shuffle needs them all)"
    )
    eval_every_steps: int = Field(10, ge=0, description="0 disables periodic evaluation")
    eval_size: int = Field(
        500, ge=1, description="held-out rows one evaluation scores (rows; the first ones of eval_path)"
    )
    eval_batch_size: int = Field(
        64,
        ge=1,
        description="held-out rows (or episodes' turns) the trainer generates in one greedy call (rows); an "
        "evaluation of eval_size rows makes eval_size / eval_batch_size calls, so its memory stays that of this many "
        "sequences",
    )
    shuffle: bool = Field(
        True, description="visit the training rows in a seeded (train.seed) random order each epoch; false = file order"
    )

    @field_validator("train_path", "eval_path")
    @classmethod
    def _file_exists(cls, path: Path | None) -> Path | None:
        if path is not None and not path.exists():
            raise ValueError(f"data file or folder {str(path)!r} does not exist")
        return path
