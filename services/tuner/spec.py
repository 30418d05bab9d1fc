"""The tune file: what ``rlpipe tune FILE`` searches, how it scores a trial, and what it may spend.

Defaults and the search space are kept apart: ``base_config`` is an ordinary run config (the one
``rlpipe run`` takes), and ``space`` names the run config's own dotted keys with a range or choices
each. Everything is checked when the tuner starts, before any trial runs: an unknown key, a section
instead of a field, an empty range, a log range touching zero, or a bound the run config itself
refuses (``sampling.temperature: 0``) stops it with the key named.

Example (examples/tune-arith.yaml has a full one)::

    study: arith
    base_config: examples/arith-grpo.yaml
    space:
      train.learning_rate: {type: float, low: 1.0e-5, high: 1.0e-1, log: true}
      sampling.group_size: {type: categorical, choices: [4, 8]}
      train.clip.high: {type: float, low: 0.2, high: 0.4, when: {param: train.algorithm, in: [grpo, dr_grpo]}}
    objective: {metric: eval_accuracy, reduce: final, direction: maximize}
    pruner: {kind: median, warmup_steps: 20}
    budget: {max_trials: 12, max_wall_s: 1800}
    trial: {max_steps: 80, max_wall_s: 300, max_rss_gb: 8}
    parallel: {device_slots: ["0", "1"]}          # two trials at a time, one GPU each

Paths (``base_config``, ``workdir``, a ``journal:``/``sqlite:`` storage) are relative to the working
directory, as the paths inside run configs are.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Scalar = str | int | float | bool


class TuneFileError(ValueError):
    """A tune file the tuner refuses to start with; the message names every bad key."""


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Condition(Spec):
    """Sample a parameter only when another key's value is one of ``in``.

    ``param`` is another parameter of the space (listed before this one, so it is sampled first) or,
    when the space does not vary it, a key of the base config (then the condition is fixed for the study).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    param: str
    values: list[Scalar] = Field(alias="in", min_length=1)


class FloatParam(Spec):
    type: Literal["float"]
    low: float
    high: float
    log: bool = Field(
        default=False, description="sample uniformly in log space (learning rates, coefficients over decades)"
    )
    step: float | None = Field(default=None, gt=0, description="discretise the range (not with log)")
    when: Condition | None = None

    @model_validator(mode="after")
    def _a_range(self) -> FloatParam:
        _check_range(self.low, self.high, self.log)
        if self.log and self.step is not None:
            raise ValueError("step and log cannot be combined (Optuna samples either a grid or a log scale)")
        return self


class IntParam(Spec):
    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int = Field(default=1, ge=1)
    when: Condition | None = None

    @model_validator(mode="after")
    def _a_range(self) -> IntParam:
        _check_range(self.low, self.high, self.log)
        if self.log and self.step != 1:
            raise ValueError("step and log cannot be combined (Optuna samples either a grid or a log scale)")
        return self


class CategoricalParam(Spec):
    type: Literal["categorical"]
    choices: list[Scalar] = Field(min_length=1)
    when: Condition | None = None

    @field_validator("choices")
    @classmethod
    def _distinct(cls, choices: list[Scalar]) -> list[Scalar]:
        if len({repr(c) for c in choices}) != len(choices):
            raise ValueError(f"choices must be distinct, got {choices}")
        return choices


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


def _check_range(low: float, high: float, log: bool) -> None:
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"low and high must be finite numbers, got {low}..{high}")
    if low >= high:
        raise ValueError(f"empty range: low ({low}) must be below high ({high}); a fixed value belongs in base_config")
    if log and low <= 0:
        raise ValueError(f"a log range must be positive, got low={low}")


USAGE_PREFIX = "usage."  # a metric named usage.<quantity> is read from the trial's usage.json once it has ended


class MetricConstraint(Spec):
    """A trial is feasible only if ``reduce`` over the metric's values stays below / above a bound."""

    metric: str = Field(
        description="a key of the run's metrics.jsonl rows (one docs/metrics.md declares), or usage.<quantity> "
        "(cost, cost_per_step, cost_per_accuracy_point, cpu_core_hours, gpu_hours) from the finished run's usage.json"
    )
    reduce: Literal["final", "max", "min", "mean"] = "max"
    below: float | None = None
    above: float | None = None

    @model_validator(mode="after")
    def _one_bound(self) -> MetricConstraint:
        if (self.below is None) == (self.above is None):
            raise ValueError("give exactly one of below / above")
        return self


class AlertConstraint(Spec):
    """A trial is feasible only if no alert of this severity or worse fired during it."""

    no_alert: Literal["info", "warning", "critical"]


class Objective(Spec):
    metric: str = Field(
        default="eval_accuracy",
        description="a key of the run's metrics.jsonl rows (one docs/metrics.md declares), or usage.<quantity> from "
        "the finished run's usage.json (e.g. usage.cost_per_accuracy_point, direction minimize; known only at a "
        "trial's end, so pruner.kind: none)",
    )
    reduce: Literal["final", "best", "mean_last_k"] = Field(
        default="final",
        description="final: the last value; best: the best by direction; mean_last_k: mean of the last k",
    )
    k: int = Field(default=3, ge=1, description="values averaged by mean_last_k")
    direction: Literal["maximize", "minimize"] = "maximize"
    constraints: list[MetricConstraint | AlertConstraint] = Field(
        default_factory=list, description="feasibility rules; an infeasible trial never becomes the best"
    )


class Pruner(Spec):
    kind: Literal["none", "median", "successive_halving"] = "median"
    startup_trials: int = Field(default=3, ge=0, description="median: trials completed before any is pruned")
    warmup_steps: int = Field(default=0, ge=0, description="median: trainer steps of a trial before it may be pruned")
    min_resource: int = Field(default=1, ge=1, description="successive_halving: steps of the first rung")
    reduction_factor: int = Field(
        default=3, ge=2, description="successive_halving: 1/factor of trials promoted per rung"
    )


class Sampler(Spec):
    kind: Literal["tpe", "random"] = "tpe"
    seed: int | None = None
    startup_trials: int = Field(default=5, ge=0, description="tpe: random trials before it models the space")


class Budget(Spec):
    max_trials: int = Field(
        default=20, ge=1, description="trials of the study claimed (running or ended, not duplicates), over all workers"
    )
    max_wall_s: float | None = Field(
        default=None, gt=0, description="from the study's first trial, over all workers; a trial is cut at it"
    )
    max_device_hours: float | None = Field(
        default=None, gt=0, description="summed over the study's trials: GPUs x hours, or wall hours for CPU trials"
    )


class TrialLimits(Spec):
    max_steps: int | None = Field(
        default=None, ge=1, description="caps train.total_steps of every trial (the base config's and a sampled one)"
    )
    max_wall_s: float = Field(
        default=3600.0, gt=0, description="from the trial's launch; past it the trial is a timeout"
    )
    max_rss_gb: float | None = Field(default=None, gt=0, description="host RSS of the trial's whole process tree")
    max_gpu_gb: float | None = Field(
        default=None, gt=0, description="device memory of the trial's processes (needs NVML)"
    )
    stop_grace_s: float = Field(
        default=30.0, gt=0, description="after SIGTERM, before SIGKILL of the trial's process group"
    )
    poll_s: float = Field(default=0.5, gt=0, description="how often metrics, limits and the pruner are checked")


class Parallel(Spec):
    """Trials side by side: on this machine (device slots) and across workers sharing one study."""

    device_slots: list[str] = Field(
        default_factory=list,
        description='one trial at a time per slot, each started with CUDA_VISIBLE_DEVICES=<slot> ("0", "1,2"); '
        "empty: one trial at a time, with the tuner's own devices",
    )
    heartbeat_s: int = Field(
        default=10, ge=1, description="a database study: how often each running trial's worker records that it is alive"
    )
    stale_after_s: int = Field(
        default=60,
        ge=2,
        description="a database study: a running trial without a heartbeat this long is failed (its worker died)",
    )

    @field_validator("device_slots")
    @classmethod
    def _distinct_devices(cls, slots: list[str]) -> list[str]:
        seen: set[str] = set()
        for slot in slots:
            if not re.fullmatch(r"[A-Za-z0-9-]+(,[A-Za-z0-9-]+)*", slot):
                raise ValueError(
                    f"{slot!r} is not a CUDA_VISIBLE_DEVICES value (device indices or UUIDs, comma-separated)"
                )
            devices = set(slot.split(","))
            if devices & seen:
                raise ValueError(f"slot {slot!r} shares devices {sorted(devices & seen)} with another slot")
            seen |= devices
        return slots

    @model_validator(mode="after")
    def _grace_above_beat(self) -> Parallel:
        if self.stale_after_s <= self.heartbeat_s:
            raise ValueError(
                f"stale_after_s ({self.stale_after_s}) must exceed heartbeat_s ({self.heartbeat_s}), "
                "or live trials are failed between two heartbeats"
            )
        return self


class TuneSpec(Spec):
    study: str = Field(pattern=r"^[A-Za-z0-9_-]{1,48}$", description="study name; trial run ids are <study>-t<N>")
    base_config: Path = Field(description="the run config every trial starts from")
    workdir: Path | None = Field(
        default=None, description="trial configs, runs and the journal; default runs/tune/<study>"
    )
    storage: str = Field(
        default="",
        description="empty: a journal file in workdir; journal:PATH, sqlite:///PATH, or postgresql://... when "
        "tuners on several machines share the study (`rlpipe tune --storage` / RLPIPE_TUNE_STORAGE overrides it)",
    )
    fixed: dict[str, Scalar] = Field(
        default_factory=dict,
        description="dotted keys set the same in every trial (eval cadence, checkpoint cadence): the study's own "
        "settings, kept out of the base config that `rlpipe run` also uses",
    )
    space: dict[str, Param] = Field(min_length=1)
    objective: Objective = Objective()
    pruner: Pruner = Pruner()
    sampler: Sampler = Sampler()
    budget: Budget = Budget()
    trial: TrialLimits = TrialLimits()
    parallel: Parallel = Parallel()
    keep_checkpoints: int = Field(
        default=3, ge=0, description="checkpoints kept for the best few trials; others' deleted"
    )
    enqueue: list[dict[str, Scalar]] = Field(
        default_factory=list, description="parameter sets run first, in order (known-good configs, regressions)"
    )

    @field_validator("storage")
    @classmethod
    def _known_storage(cls, url: str) -> str:
        if url and not re.match(r"^(journal:.+|sqlite:///.+|postgresql(\+\w+)?://.+)$", url):
            raise ValueError(f"{url!r} is not journal:PATH, sqlite:///PATH or postgresql://...")
        return url

    @property
    def work_dir(self) -> Path:
        return self.workdir or Path("runs") / "tune" / self.study

    @property
    def storage_url(self) -> str:
        return self.storage or f"journal:{self.work_dir / 'study.journal'}"

    def trial_run_id(self, number: int) -> str:
        return f"{self.study}-t{number}"
