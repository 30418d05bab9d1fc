"""The model and data sections: the policy model, its LoRA adapters, and the prompts to train and evaluate on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from services.common.config.base import Live, NewRun, Restart, Section, Security


class LoraConfig(Section):
    """LoRA adapters on the policy (peft): only they train, have optimizer state, sync and are checkpointed."""

    r: NewRun[int] = Field(
        default=16, gt=0, description="rank of each adapter: the inner dimension of its A and B matrices (> 0)"
    )
    alpha: NewRun[float] = Field(
        default=32.0, gt=0, description="scale numerator (> 0): an adapter's update B @ A is multiplied by alpha / r"
    )
    dropout: NewRun[float] = Field(
        default=0.0, ge=0.0, lt=1.0, description="dropout probability on each adapter's input while training (0 to <1)"
    )
    target_modules: NewRun[list[str]] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="names of the Linear modules that get an adapter (the last part of a module's path, e.g. "
        "q_proj); each must name one of the model's Linear modules, or the trainer refuses to start listing them",
    )


# Where a model may be fetched from instead of a local folder: an S3 prefix, or a Hugging Face repository
# (``hf://org/name``, optionally ``@revision``).
REMOTE_MODEL = re.compile(r"^(s3://[^/]+/.*|hf://[^/@]+/[^/@]+(@[^/@]+)?)$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ModelFetchConfig(Section):
    """Where a model named by URL (model.path s3://... or hf://...) comes from and is kept (docs/operations.md,
    "Model preparation"). A fetched model lands in cache_dir once and is reused by every later start."""

    cache_dir: Security[Path] = Field(
        default=Path("models/cache"),
        description="folder fetched models are kept in, one folder per source (downloaded to a temporary folder "
        "beside it, verified, then renamed into place); every role on this machine reuses it",
    )
    s3_endpoint: Security[str] = Field(
        default="",
        description="host:port of the S3 endpoint an s3:// model.path is read from; empty = checkpoint.s3_endpoint "
        "(with its s3_secure, s3_ca_file and s3_region). Credentials: RLPIPE_MODEL_S3_ACCESS_KEY and "
        "RLPIPE_MODEL_S3_SECRET_KEY, else the checkpoint store's RLPIPE_S3_ACCESS_KEY and RLPIPE_S3_SECRET_KEY",
    )
    s3_secure: Security[bool | None] = Field(
        default=None,
        description="speak HTTPS to s3_endpoint (false: plain HTTP, a local MinIO); null = checkpoint.s3_secure",
    )
    hub_download: Security[bool] = Field(
        default=False,
        description="fetch an hf:// model.path that is in neither hub_cache_dir nor cache_dir from hub_endpoint; off "
        "by default, so no role reaches the Hugging Face Hub unless asked to",
    )
    hub_endpoint: Security[str] = Field(
        default="https://huggingface.co",
        description="the Hub, or a mirror of it serving the Hub's URL layout (/{repo}/resolve/{revision}/{file} and "
        "/api/models/{repo}/revision/{revision}), as HF_ENDPOINT names one; its token: RLPIPE_MODEL_HUB_TOKEN",
    )
    hub_cache_dir: Security[Path | None] = Field(
        default=None,
        description="a Hugging Face hub cache folder (HF_HUB_CACHE's layout: models--org--name/snapshots/...) looked "
        "in first for an hf:// model.path; a snapshot there is used in place, without a network request",
    )
    timeout_s: Restart[float] = Field(
        default=60.0, gt=0, description="one request to the S3 endpoint or hub_endpoint (seconds)"
    )

    @field_validator("hub_endpoint")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not re.match(r"^https?://[^/]+", url):
            raise ValueError(f"{url!r} must be an http:// or https:// URL")
        return url.rstrip("/")


class ModelConfig(Section):
    path: Security[Path | str] = Field(
        description="the model: a local Hugging Face model folder (config.json, weights, tokenizer), an S3 "
        "prefix (s3://bucket/prefix/) or a Hugging Face repository (hf://org/name or hf://org/name@revision; pin a "
        "commit: a branch is fetched once and then kept) fetched once into model.fetch.cache_dir"
    )
    sha256: Security[str | None] = Field(
        default=None,
        description="the model folder's content hash, checked by every role at start (a mismatch refuses "
        "the start naming both hashes): sha256 of the lines '<sha256>  <file>' of every file (dot-files aside) in "
        "path order, what `rlpipe doctor` prints as the model hash",
    )
    manifest: Security[dict[str, str] | None] = Field(
        default=None,
        description="{file: sha256} of every file of the model folder (dot-files aside), checked by every "
        "role at start; a fetch downloads exactly these files. Either this or sha256, or neither",
    )
    fetch: ModelFetchConfig = Field(
        default=ModelFetchConfig(), description="where a model named by URL is fetched from"
    )
    dtype: Restart[Literal["float32", "bfloat16"]] = Field(
        default="float32",
        description="weights and activations of rollout, reference and evaluation, and the trainer's compute dtype "
        "(its parameters stay float32 by default: train.master_weights). float16 is refused: the trainer has no loss "
        "scaling, so its small gradients would underflow to zero",
    )
    device: Restart[Literal["auto", "cpu", "cuda"]] = Field(
        default="auto",
        description="where the trainer, critic, reference and evaluation run: auto = CUDA when this process sees a "
        "GPU, else CPU; cuda without a GPU stops the service at start",
    )
    lora: LoraConfig | None = Field(
        default=None,
        description="train LoRA adapters instead of every weight (None = full weights); the reference and the "
        "rollout keep the base model at path",
    )

    @field_validator("path", mode="before")
    @classmethod
    def _local_or_remote(cls, value: Any) -> Any:
        """A URL stays text (a Path would fold its ``//``); anything else is a local folder."""
        if isinstance(value, str) and "://" in value:
            if not REMOTE_MODEL.match(value):
                raise ValueError(
                    f"{value!r} is no model source: a local folder, s3://bucket/prefix/ or hf://org/name[@revision]"
                )
            return value
        return Path(value) if isinstance(value, str) else value

    @field_validator("path")
    @classmethod
    def _folder_with_config(cls, path: Path | str) -> Path | str:
        if isinstance(path, str):  # fetched at start (services/common/transport/model_source.py)
            return path
        if not path.is_dir():
            raise ValueError(f"model folder {str(path)!r} does not exist")
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json")
        return path

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, digest: str | None) -> str | None:
        if digest is not None and not SHA256.match(digest.lower()):
            raise ValueError(f"{digest!r} is not a sha256 hex digest (64 hex digits)")
        return digest.lower() if digest is not None else None

    @field_validator("manifest")
    @classmethod
    def _file_digests(cls, manifest: dict[str, str] | None) -> dict[str, str] | None:
        if manifest is None:
            return None
        if not manifest:
            raise ValueError("an empty manifest lists no file; leave it null")
        for name, digest in manifest.items():
            parts = Path(name).parts
            if Path(name).is_absolute() or ".." in parts or any(part.startswith(".") for part in parts):
                raise ValueError(f"{name!r} is not a file inside the model folder (relative, no '..', no dot-files)")
            if not SHA256.match(digest.lower()):
                raise ValueError(f"{name}: {digest!r} is not a sha256 hex digest (64 hex digits)")
        return {name: digest.lower() for name, digest in manifest.items()}

    @model_validator(mode="after")
    def _one_kind_of_hash(self) -> ModelConfig:
        if self.sha256 is not None and self.manifest is not None:
            raise ValueError("model.sha256 and model.manifest both pin the files: give one of them")
        return self

    @property
    def remote(self) -> bool:
        """Whether ``path`` names a source to fetch from rather than a folder here (until ``resolve_model``)."""
        return isinstance(self.path, str)

    @property
    def folder(self) -> Path:
        """The local model folder: ``path``, once ``resolve_model`` has fetched a URL's model (a role loads the model
        only after it)."""
        if isinstance(self.path, str):
            raise RuntimeError(f"model.path {self.path} is not fetched yet: resolve_model comes before loading it")
        return self.path


class DataColumns(Section):
    """Which of a dataset's columns hold what a row needs (docs/configuration.md, data.columns)."""

    prompt: Restart[str] = Field(default="prompt", min_length=1, description="the plain prompt text")
    messages: Restart[str] = Field(
        default="messages", min_length=1, description="a chat ([{role, content}, ...]) rendered with the chat template"
    )
    answer: Restart[str] = Field(
        default="answer", min_length=1, description="the reference answer the reward compares with"
    )
    id: Restart[str] = Field(
        default="id", min_length=1, description="a row's stable id (optional; the row's index otherwise)"
    )
    info: Restart[str] = Field(
        default="info",
        min_length=1,
        description="a JSON object (or text holding one) with what the row's environment needs (test cases, a "
        "game's seed), given to its reset as Task.info (optional; multi-turn runs, docs/agents.md). Under the "
        "default name a value that is not one is left out; under a name you set it is a bad row",
    )


class DataConfig(Section):
    task_name: Restart[str] = Field(
        default="arithmetic",
        description="a label for what the data asks (arithmetic, word-problems, ...): kept with the config and in the "
        "run's records; which rows are read is train_path's, how they are scored reward.functions'",
    )
    train_path: Security[Path] = Field(
        description="JSON Lines file, or a local Hugging Face dataset: a save_to_disk folder, a Parquet, Arrow, "
        "JSON or CSV file, or a folder of them"
    )
    eval_path: Security[Path | None] = Field(default=None, description="held-out rows, in any form train_path takes")
    split: Restart[str] = Field(
        default="train", min_length=1, description="the split of train_path to train on, when it holds several"
    )
    eval_split: Restart[str] = Field(
        default="test", min_length=1, description="the split of eval_path to evaluate on, when it holds several"
    )
    columns: DataColumns = Field(default=DataColumns(), description="which dataset columns hold a row's parts (names)")
    streaming: Restart[bool] = Field(
        default=False,
        description="read train_path as a stream instead of all at once, for datasets larger than memory: rows are "
        "checked as they come (a bad one is skipped and logged) and a resume reads up to its place again",
    )
    shuffle_buffer: Restart[int] = Field(
        default=10_000, ge=1, description="rows a streamed dataset is shuffled within (a full shuffle needs them all)"
    )
    eval_every_steps: Live[int] = Field(default=10, ge=0, description="0 disables periodic evaluation")
    eval_size: Restart[int] = Field(
        default=500, ge=1, description="held-out rows one evaluation scores (rows; the first ones of eval_path)"
    )
    eval_batch_size: Restart[int] = Field(
        default=64,
        ge=1,
        description="held-out rows (or episodes' turns) the trainer generates in one greedy call (rows); an "
        "evaluation of eval_size rows makes eval_size / eval_batch_size calls, so its memory stays that of this many "
        "sequences",
    )
    shuffle: Restart[bool] = Field(
        default=True,
        description="visit the training rows in a seeded (train.seed) random order each epoch; false = file order",
    )
    tokenize_workers: Restart[int] = Field(
        default=1,
        ge=1,
        le=64,
        description="processes that render chat prompts and tokenize them: the trainer's feeder (rows rendered ahead "
        "of the walk) and held-out rows, the rollout's prompts. 1 = in the role's own process, as one core does; "
        "more pays only where many rows are prepared at once (docs/performance.md, Pre-processing)",
    )

    @field_validator("train_path", "eval_path")
    @classmethod
    def _file_exists(cls, path: Path | None) -> Path | None:
        if path is not None and not path.exists():
            raise ValueError(f"data file or folder {str(path)!r} does not exist")
        return path
