"""The rollout's agent metrics: episodes by outcome, turns, tool calls and errors, time waiting on the environment."""

from __future__ import annotations

from collections import Counter

from services.common.episodes.episode_state import EpisodeState
from services.common.observe.instruments import LATENCY_BUCKETS_S
from services.common.observe.telemetry import meter


class EpisodeMetrics:
    """The rollout's agent metrics (Prometheus via the telemetry's meter), and a tally of outcomes for its log."""

    def __init__(self) -> None:
        m = meter()
        self.outcomes: Counter[str] = Counter()
        self.episodes = m.create_counter("rlpipe_rollout_episodes", unit="{episode}", description="by outcome")
        self.turns = m.create_histogram(
            "rlpipe_rollout_episode_turns",
            unit="{turn}",
            description="model turns per episode",
            explicit_bucket_boundaries_advisory=(1, 2, 3, 4, 6, 8, 12, 16, 32),
        )
        self.tool_calls = m.create_counter("rlpipe_rollout_tool_calls", unit="{call}", description="tool calls")
        self.tool_errors = m.create_counter(
            "rlpipe_rollout_tool_errors", unit="{call}", description="tool calls that failed (malformed, or raised)"
        )
        self.env_latency = m.create_histogram(
            "rlpipe_rollout_env_seconds",
            unit="s",
            description="time one episode spent waiting on its environment",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.env_reward = m.create_histogram(
            "rlpipe_rollout_env_reward", description="the environment's own reward parts, summed over an episode"
        )

    def record(self, episodes: list[EpisodeState]) -> None:
        for episode in episodes:
            assert episode.outcome is not None
            self.outcomes[episode.outcome] += 1
            self.episodes.add(1, {"outcome": episode.outcome})
            self.turns.record(episode.turns)
            self.tool_calls.add(episode.tool_calls)
            self.tool_errors.add(episode.tool_errors)
            self.env_latency.record(episode.env_seconds)
            self.env_reward.record(episode.env_reward)
