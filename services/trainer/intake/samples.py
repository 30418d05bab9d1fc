"""The sample archive: what the trainer applied at each step, for the operator's spot checks.

``runs/<run>/samples/step_<N>.jsonl`` holds one line per group applied at step N: its
prompt, and per completion the text, reward, finish reason and a summary of its
per-token sampling logprobs and of their distance to the reference. It is written from
the groups the trainer applies (not from EXPERIENCE, which is purged), and bounded: the
newest ``keep_steps`` steps stay. A step recorded again after a rollback replaces the
file of the same number, and files of later steps, which belong to the abandoned branch,
are deleted, so the archive always shows the branch the current model came from.

``rlpipe samples`` reads it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.files import write_atomically
from services.common.transport.messages import ExperienceGroup

_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")


@dataclass(frozen=True)
class CompletionSample:
    text: str
    reward: float
    finish_reason: str
    tokens: int  # the tokens the model sampled; an episode's observations are not the model's and not counted
    logprob_mean: float  # mean sampling logprob per model token
    logprob_min: float  # the least likely token the sampler drew
    kl_mean: float  # mean per-token log ratio log pi_sample - log pi_ref (the k1 estimate of KL to the reference)
    kl_max: float  # the model token furthest from the reference
    observation_tokens: int = 0  # tokens an environment inserted (loss mask 0): in the text, in no statistic
    mask: str = ""  # the loss mask as runs, "M12 O5 M8": model tokens, then observation tokens, ...; "" = all model


@dataclass(frozen=True)
class GroupSample:
    step: int
    group_id: str
    policy_version: int  # the version that generated the group
    prompt: str
    answer: str
    completions: list[CompletionSample]

    @property
    def reward_mean(self) -> float:
        return float(np.mean([c.reward for c in self.completions]))

    def to_json(self) -> str:
        # vars, not dataclasses.asdict, which deep-copies every field on the way (most of the archive's cost).
        return json.dumps({**vars(self), "completions": [vars(c) for c in self.completions]})

    @classmethod
    def from_json(cls, line: str) -> GroupSample:
        raw = json.loads(line)
        return cls(**{**raw, "completions": [CompletionSample(**c) for c in raw["completions"]]})


def mask_runs(mask: np.ndarray) -> str:
    """The loss mask as runs of model (M) and observation (O) tokens, "M12 O5 M8"; "" when every token is the
    model's."""
    if mask.all():
        return ""
    edges = np.flatnonzero(np.diff(mask)) + 1
    return " ".join(f"{'M' if run[0] else 'O'}{run.size}" for run in np.split(mask, edges))


def summarize(step: int, group: ExperienceGroup) -> GroupSample:
    """One applied group as the archive keeps it. Each statistic is one numpy reduction over the group's
    completions laid end to end (a step archives hundreds of completions; per-completion calls cost more than
    the arithmetic). Only the model's own tokens count: an episode's observation tokens (loss mask 0) carry no
    sampling logprob (0 by convention) and were never the policy's choice, so they would read as certain tokens
    and pull the means, and their log ratio to the reference is no KL of the policy's."""
    masks = [
        np.ones(c.logprobs.size, dtype=bool) if c.loss_mask is None else c.loss_mask.astype(bool)
        for c in group.completions
    ]
    lengths = np.array([c.logprobs.size for c in group.completions])
    model = np.concatenate([*masks, np.zeros(0, dtype=bool)])  # (T,) 1 on model tokens
    logprobs = np.concatenate([c.logprobs for c in group.completions] + [np.zeros(0)]).astype(np.float64)  # (T,)
    log_ratio = logprobs - np.concatenate([*group.ref_logprobs, np.zeros(0)]).astype(np.float64)  # (T,)
    # A completion that stopped at once has no tokens: its statistics are 0, and the reductions skip it (reduceat
    # over the non-empty ones only, each segment running to the next one's start).
    filled = lengths > 0
    starts = (np.cumsum(lengths) - lengths)[filled]
    stats = np.zeros((4, len(lengths)))
    counts = np.zeros(len(lengths))
    if starts.size:
        counts[filled] = np.add.reduceat(model.astype(np.float64), starts)  # >= 1: a mask has a model token
        stats[:, filled] = [
            np.add.reduceat(np.where(model, logprobs, 0.0), starts) / counts[filled],
            np.minimum.reduceat(np.where(model, logprobs, np.inf), starts),
            np.add.reduceat(np.where(model, log_ratio, 0.0), starts) / counts[filled],
            np.maximum.reduceat(np.where(model, log_ratio, -np.inf), starts),
        ]
    logprob_mean, logprob_min, kl_mean, kl_max = stats.tolist()
    completions = [
        CompletionSample(
            text=completion.text,
            reward=float(reward),
            finish_reason=completion.finish_reason,
            tokens=int(counts[n]),
            logprob_mean=logprob_mean[n],
            logprob_min=logprob_min[n],
            kl_mean=kl_mean[n],
            kl_max=kl_max[n],
            observation_tokens=int(lengths[n] - counts[n]),
            mask=mask_runs(masks[n]),
        )
        for n, (completion, reward) in enumerate(zip(group.completions, group.rewards, strict=True))
    ]
    return GroupSample(step, group.group_id, group.policy_version, group.prompt, group.answer, completions)


class SampleArchive:
    """``<folder>/step_<N>.jsonl`` for the newest ``keep_steps`` steps; ``keep_steps`` 0 keeps nothing."""

    def __init__(self, folder: Path, keep_steps: int):
        self.folder = folder
        self.keep_steps = keep_steps

    def path(self, step: int) -> Path:
        return self.folder / f"step_{step}.jsonl"

    def record(self, step: int, groups: list[ExperienceGroup]) -> None:
        """Keep the groups applied at ``step``; drop steps older than the window and those of an abandoned branch."""
        if self.keep_steps == 0:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        # Whole file or nothing: a reader (or a crash) never meets half a step.
        write_atomically(self.path(step), "".join(summarize(step, g).to_json() + "\n" for g in groups).encode())
        for stored in self.steps():
            if stored > step or stored <= step - self.keep_steps:
                self.path(stored).unlink(missing_ok=True)

    def steps(self) -> list[int]:
        """The archived steps, oldest first."""
        if not self.folder.is_dir():
            return []
        found = (_STEP_FILE.match(path.name) for path in self.folder.iterdir())
        return sorted(int(match.group(1)) for match in found if match)

    def read(self, step: int) -> list[GroupSample]:
        """The groups applied at ``step``; FileNotFoundError when the step is not (or no longer) archived."""
        return [GroupSample.from_json(line) for line in self.path(step).read_text().splitlines() if line.strip()]
