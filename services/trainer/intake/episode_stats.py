"""Per-step statistics of multi-turn episodes (``Completion.episode``), as the ``agent/...`` keys of a step row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import numpy as np

from services.common.transport.messages import Episode, ExperienceGroup

OUTCOMES: tuple[str, ...] = get_args(Episode.model_fields["outcome"].annotation)


def episodes_of(groups: Sequence[ExperienceGroup]) -> list[Episode]:
    return [c.episode for g in groups for c in g.completions if c.episode is not None]


def episode_metrics(groups: Sequence[ExperienceGroup], filtered: Sequence[Episode] = ()) -> dict[str, float]:
    """Means over the completions of ``groups`` that are episodes, and over ``filtered`` (the episodes of groups
    dynamic sampling left out: an environment failing every episode of a group scores it alike, and leaving those
    out would hide the failures): turns, tool calls, tool errors and seconds in the environment per episode, and the
    share of episodes that ended each way (``agent/outcome/<outcome>``, every outcome named, 0 where none ended so,
    so an alert rule always finds its key). Empty when none is an episode."""
    episodes = [*episodes_of(groups), *filtered]
    if not episodes:
        return {}
    outcomes = [episode.outcome for episode in episodes]
    return {
        "agent/turns_mean": float(np.mean([e.turns for e in episodes])),
        "agent/tool_calls_mean": float(np.mean([e.tool_calls for e in episodes])),
        "agent/tool_errors_mean": float(np.mean([e.tool_errors for e in episodes])),
        "agent/env_seconds_mean": float(np.mean([e.env_seconds for e in episodes])),
        **{f"agent/outcome/{name}": outcomes.count(name) / len(episodes) for name in OUTCOMES},
    }
