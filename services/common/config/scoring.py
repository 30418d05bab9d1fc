"""The scoring sections: the reward role (functions, a model, a remote service, the overlong penalty), the reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from services.common import registry
from services.common.config.base import Live, Restart, Section, Security, read_environment
from services.common.config.tokens import TokenError, header_value_problem, read_token_file


class RewardModelConfig(Section):
    """A Hugging Face sequence classifier scoring (prompt, completion) pairs; see docs/rewards.md."""

    path: Security[Path] = Field(
        description="AutoModelForSequenceClassification folder (config.json, weights, tokenizer)"
    )
    weight: Restart[float] = Field(default=1.0, description="its score's weight in the reward, beside reward.functions")
    batch_size: Restart[int] = Field(default=16, ge=1, description="pairs per forward pass")
    max_length: Restart[int] = Field(
        default=512, ge=8, description="tokens per pair; longer ones lose their start, keeping the answer"
    )
    device: Restart[Literal["auto", "cpu", "cuda"]] = Field(
        default="auto",
        description="auto = CUDA when this replica sees a GPU; cuda without one stops the replica at start",
    )
    normalize: Restart[bool] = Field(
        default=True, description="score = sigmoid(logit), in (0, 1) like the rule functions; false = the raw logit"
    )

    @field_validator("path")
    @classmethod
    def _folder_with_config(cls, path: Path) -> Path:
        if not (path / "config.json").is_file():
            raise ValueError(f"reward model folder {str(path)!r} does not exist or has no config.json")
        return path


class RewardHttpConfig(Section):
    """A remote reward service: batched JSON POSTs of (prompt, completion, answer, metadata) -> scores."""

    url: Security[str] = Field(pattern=r"^https?://\S+$", description="the endpoint taking the POST (docs/rewards.md)")
    weight: Restart[float] = Field(default=1.0, description="its score's weight in the reward, beside reward.functions")
    timeout_s: Restart[float] = Field(
        default=10.0, gt=0, description="one request's limit; a slower answer counts as a failure"
    )
    retries: Restart[int] = Field(
        default=2, ge=0, description="retries of a failed request before the group waits for the service"
    )
    backoff_s: Restart[float] = Field(
        default=0.5, gt=0, description="wait before the first retry, doubled for each next one"
    )
    max_concurrency: Restart[int] = Field(default=4, ge=1, description="requests in flight at once from one replica")
    batch_size: Restart[int] = Field(default=64, ge=1, description="completions per request")
    headers_from_env: Security[dict[str, str]] = Field(
        default_factory=dict,
        description="header name -> environment variable holding its value (a token stays out of the YAML)",
    )
    token_file: Security[Path | None] = Field(
        default=None,
        description="file holding the bearer token sent as 'Authorization: Bearer <token>' (one line of printable "
        "ASCII), read before each batch: rewrite the file to rotate the token without a restart. A file that is "
        "missing or holds no sendable token stops the start; met while running, it holds the groups and alerts",
    )
    max_response_bytes: Restart[int] = Field(
        default=1 << 20,
        ge=1024,
        description="bytes; a longer answer is the service's fault (the groups wait) and is never read whole",
    )
    _headers: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("token_file")
    @classmethod
    def _holds_a_sendable_token(cls, token_file: Path | None) -> Path | None:
        # At start only: an override checked later is validated by the trainer's admin, on a host where this file
        # need not be. The error names the problem, never the token (services/common/config/tokens.py).
        if token_file is not None and read_environment.get():
            try:
                read_token_file(token_file, "token_file")
            except TokenError as error:
                raise ValueError(str(error).removeprefix("token_file: ")) from None
        return token_file

    @model_validator(mode="after")
    def _headers_set_in_environment(self) -> RewardHttpConfig:
        if self.token_file is not None and any(name.lower() == "authorization" for name in self.headers_from_env):
            raise ValueError("token_file and headers_from_env both set the Authorization header: keep one")
        if not read_environment.get():  # a live override checked elsewhere: this replica resolved them at start
            return self
        missing = [variable for variable in self.headers_from_env.values() if variable not in os.environ]
        if missing:
            raise ValueError(f"headers_from_env names environment variables that are not set: {missing}")
        for header, variable in self.headers_from_env.items():
            problem = header_value_problem(os.environ[variable])
            if problem is not None:  # named by its variable: the value is a credential
                raise ValueError(f"headers_from_env: {variable} (the value of header {header!r}) {problem}")
        self._headers = {header: os.environ[variable] for header, variable in self.headers_from_env.items()}
        return self

    @property
    def headers(self) -> dict[str, str]:
        """The request headers, their values read from the environment when the config was loaded."""
        return dict(self._headers)


class OverlongPenaltyConfig(Section):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476), scored as the reward part ``overlong``."""

    max_tokens: Restart[int] = Field(ge=1, description="a completion of more model tokens than this scores -1 (tokens)")
    buffer_tokens: Restart[int] = Field(
        ge=1,
        description="the soft zone below max_tokens: over max_tokens - buffer_tokens the score falls linearly from 0 "
        "to -1 at max_tokens (tokens)",
    )
    weight: Restart[float] = Field(
        default=1.0, gt=0, description="its score's weight in the reward, beside reward.functions"
    )

    @model_validator(mode="after")
    def _buffer_inside_the_limit(self) -> OverlongPenaltyConfig:
        if self.buffer_tokens > self.max_tokens:
            raise ValueError(
                f"buffer_tokens ({self.buffer_tokens}) must be at most max_tokens ({self.max_tokens}): the soft zone "
                "lies below the limit"
            )
        return self


class RewardConfig(Section):
    functions: Live[dict[str, float]] = Field(
        default_factory=lambda: {"exact_match": 1.0},
        description="name or 'module:function' import path -> weight (docs/rewards.md)",
    )
    function_timeout_s: Restart[float] = Field(
        default=10.0, gt=0, description="one function on one completion; past it that score is 0 and the call is killed"
    )
    model: RewardModelConfig | None = Field(default=None, description="a reward model, scored as 'model'")
    http: RewardHttpConfig | None = Field(default=None, description="a remote reward service, scored as 'http'")
    overlong_penalty: OverlongPenaltyConfig | None = Field(
        default=None, description="penalise completions near or past a length limit, scored as 'overlong'; null: off"
    )
    environment_weight: Live[float] = Field(
        default=0.0,
        description="weight of the environment's own reward, its StepResult.reward_part summed over an episode, "
        "scored as 'environment' (multi-turn runs; docs/agents.md); 0 = reported only, not trained on",
    )
    replicas: Restart[int] = Field(default=1, ge=1, description="reward processes `rlpipe run` starts (count)")
    batch: Restart[int] = Field(
        default=64, ge=1, description="rollout groups one reward replica pulls and scores together (groups)"
    )
    max_abs_reward: Restart[float] = Field(
        default=100.0,
        gt=0,
        description="largest |reward| a completion may get (reward units: the weighted sum of the parts); a group "
        "with a larger or non-finite one is an input fault, dead-lettered with the reason instead of trained on",
    )

    @field_validator("functions")
    @classmethod
    def _plugins_import(cls, functions: dict[str, float]) -> dict[str, float]:
        for name in functions:
            if ":" in name:  # a plugin: imported now, so a typo stops the start rather than the first group
                registry.import_function(name)
        return functions

    @model_validator(mode="after")
    def _some_reward(self) -> RewardConfig:
        if not self.functions and self.model is None and self.http is None and not self.environment_weight:
            raise ValueError(
                "no reward: name reward.functions, a reward.model, a reward.http service or a reward.environment_weight"
            )
        taken = {"model", "http", "overlong", "environment"} & set(self.functions)
        if taken:
            raise ValueError(
                f"reward.functions may not use the names {sorted(taken)}: they name the model, http, overlong and "
                "environment parts"
            )
        return self


class ReferenceConfig(Section):
    model_path: Security[Path | None] = Field(default=None, description="defaults to model.path")
    replicas: Restart[int] = Field(default=1, ge=1, description="reference processes `rlpipe run` starts (count)")
    batch: Restart[int] = Field(
        default=32, ge=1, description="scored groups one reference replica pulls and runs together (groups)"
    )
    micro_batch_tokens: Restart[int | None] = Field(
        default=None,
        ge=1,
        description="most tokens one reference forward pass holds, padding included: a pulled batch's sequences are "
        "sorted by length and cut into passes of n sequences padded to their longest L with n * L <= "
        "micro_batch_tokens (as train.micro_batch_tokens), so short sequences stop padding to the batch's longest. "
        "At least train.max_seq_len (tokens); null: one pass over the whole pulled batch",
    )
