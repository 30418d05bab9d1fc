"""Reward: ROLLOUTS -> SCORED, one scalar reward per completion and the parts it is made of.

A replica scores with up to five sources, each a *part* with a weight:

- rule functions (``reward.functions``: built-in names or ``module:function`` plugins), run in a
  child process under ``reward.function_timeout_s`` per call (``services.reward.sandbox``);
- a reward model (``reward.model``), scored as ``model`` (``services.reward.model``);
- a remote reward service (``reward.http``), scored as ``http`` (``services.reward.remote``);
- DAPO's soft overlong penalty (``reward.overlong_penalty``), scored as ``overlong`` (``overlong_scores``);
- an environment's own reward (``reward.environment_weight``), scored as ``environment``: the episode's
  ``env_reward``, its environment's reward parts summed (0 for a completion that is not an episode).

The reward is the weighted sum of the parts; each part's own scores travel in the group
(``ScoredGroup.reward_parts``) and reach the trainer's step rows as ``reward/<name>/mean``.
A rule function that raises, a remote service that blames the input (400/422 with a reason), or a reward that
is not finite or beyond ``reward.max_abs_reward`` (``check_bounds``) fails the compute: the stage retries the
group and dead-letters it after ``nats.max_deliver``, with the reason. A remote service that is down raises
``DependencyUnavailable``, one that refuses the token (or a token file that holds none) or is misconfigured
``DependencyRefused``: either way the stage holds the group and retries, spending no delivery, and a refusal alerts
at once (``services.reward.remote``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from services.common.config import OverlongPenaltyConfig, RewardConfig, RunConfig
from services.common.observe.logs import Stopwatch
from services.common.observe.telemetry import current_telemetry
from services.common.service import announce_ready, join_run, serve_stage, start_grpc_server
from services.common.transport.bus import Bus
from services.common.transport.messages import Completion, RolloutGroup, ScoredGroup, advance
from services.common.transport.stage import Stage
from services.common.transport.streams import ROLLOUTS, SCORED
from services.reward.remote import RemoteItem, RemoteScorer
from services.reward.sandbox import RuleCall, RuleSandbox

if TYPE_CHECKING:  # importing it pulls in torch and transformers, ~5 CPU seconds a rule-only replica never needs
    from services.reward.model import RewardModel

log = logging.getLogger(__name__)


@dataclass
class RewardSources:
    """What one replica scores with; ``model`` and ``remote`` only when configured."""

    rules: RuleSandbox
    model: RewardModel | None = None
    remote: RemoteScorer | None = None
    per_group: bool = False  # the model scores each group in passes of its own (train.deterministic)

    @classmethod
    def of(cls, reward: RewardConfig, torch_threads: int = 1, deterministic_seed: int | None = None) -> RewardSources:
        """``deterministic_seed``: train.seed when train.deterministic, else None."""
        model = None
        if reward.model is not None:
            import torch  # only a reward model needs it (and transformers), so only then is it imported

            from services.common.model.modeling import make_deterministic
            from services.reward.model import RewardModel

            torch.set_num_threads(torch_threads)  # run_service caps it only where the role imported torch already
            if deterministic_seed is not None:
                make_deterministic(deterministic_seed)
            model = RewardModel(reward.model)
        return cls(
            rules=RuleSandbox(reward.function_timeout_s),
            model=model,
            remote=RemoteScorer(reward.http) if reward.http is not None else None,
            per_group=deterministic_seed is not None,
        )

    def close(self) -> None:
        self.rules.close()


def weights_of(reward: RewardConfig) -> dict[str, float]:
    """Part name -> weight: the rule functions, then ``model``, ``http``, ``overlong`` and ``environment`` when
    configured."""
    weights = dict(reward.functions)
    if reward.model is not None:
        weights["model"] = reward.model.weight
    if reward.http is not None:
        weights["http"] = reward.http.weight
    if reward.overlong_penalty is not None:
        weights["overlong"] = reward.overlong_penalty.weight
    if reward.environment_weight:
        weights["environment"] = reward.environment_weight
    return weights


def model_tokens(completion: Completion) -> int:
    """The tokens the model sampled: an episode's observations and tool output are not its length."""
    return len(completion.token_ids) if completion.loss_mask is None else int(completion.loss_mask.sum())


def overlong_scores(lengths: np.ndarray, penalty: OverlongPenaltyConfig) -> np.ndarray:
    """DAPO's soft overlong punishment of completions of ``lengths`` model tokens, in [-1, 0]: 0 up to
    ``max_tokens - buffer_tokens``, then falling linearly to -1 at ``max_tokens``, and -1 past it."""
    soft_start = penalty.max_tokens - penalty.buffer_tokens
    over = (lengths.astype(np.float64) - soft_start) / penalty.buffer_tokens
    return (0.0 - np.clip(over, 0.0, 1.0)).astype(np.float32)


def combine(parts: dict[str, np.ndarray], weights: dict[str, float]) -> np.ndarray:
    """``sum_name weights[name] * parts[name]``: ``[n]`` float32 rewards from ``[n]`` scores per part."""
    total = np.zeros_like(next(iter(parts.values())), dtype=np.float64)
    for name, values in parts.items():
        total += weights[name] * values
    return total.astype(np.float32)


class RewardOutOfBounds(ValueError):
    """A completion's reward is not finite or beyond ``reward.max_abs_reward``: its group is not trained on."""


def check_bounds(group_id: str, rewards: np.ndarray, parts: dict[str, np.ndarray], bound: float) -> None:
    """Raise ``RewardOutOfBounds`` naming the first completion of ``group_id`` whose reward is NaN, infinite or
    beyond ``bound`` in absolute value, with the parts it was made of. A reward of 1e30 (a plugin's overflow, a
    reward model's raw logit gone wild) would otherwise dominate its batch's advantages and wreck the policy."""
    outside = np.flatnonzero(~(np.abs(rewards.astype(np.float64)) <= bound))
    if len(outside):
        i = int(outside[0])
        made_of = ", ".join(f"{name} {float(values[i]):g}" for name, values in parts.items())
        raise RewardOutOfBounds(
            f"group {group_id}: completion {i} has reward {float(rewards[i]):g}, outside [-{bound:g}, {bound:g}] "
            f"(reward.max_abs_reward); its parts: {made_of}"
        )


def split(flat: list[float] | np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Cut one value per completion of a batch back into one ``[n]`` float32 array per group."""
    return np.split(np.asarray(flat, dtype=np.float32), np.cumsum(sizes)[:-1])


async def score_groups(
    groups: list[RolloutGroup], reward: RewardConfig, sources: RewardSources, config_version: int = 0
) -> list[ScoredGroup]:
    """Every completion of ``groups`` scored by every part of ``reward``, as one ScoredGroup each."""
    sizes = [len(group.completions) for group in groups]
    completions = [(group, completion) for group in groups for completion in group.completions]
    per_part: dict[str, list[np.ndarray]] = {}
    if reward.functions:
        names = list(reward.functions)
        calls = [RuleCall(name, c.text, g.answer, c.finish_reason) for g, c in completions for name in names]
        flat = np.asarray(await asyncio.to_thread(sources.rules.score, calls), dtype=np.float32).reshape(-1, len(names))
        for column, name in enumerate(names):
            per_part[name] = split(flat[:, column], sizes)
    if reward.model is not None and sources.model is not None:
        pairs = [(group.prompt, completion.text) for group, completion in completions]
        passes = sizes if sources.per_group else None
        per_part["model"] = split(await asyncio.to_thread(sources.model.score, pairs, passes), sizes)
    if reward.http is not None and sources.remote is not None:
        items = [
            RemoteItem(g.prompt, c.text, g.answer, {"group_id": g.group_id, "prompt_id": g.prompt_id})
            for g, c in completions
        ]
        per_part["http"] = split(await sources.remote.score(items), sizes)
    if reward.overlong_penalty is not None:
        lengths = np.asarray([model_tokens(c) for _, c in completions])
        per_part["overlong"] = split(overlong_scores(lengths, reward.overlong_penalty), sizes)
    if reward.environment_weight:
        per_part["environment"] = split([c.episode.env_reward if c.episode else 0.0 for _, c in completions], sizes)
    weights = weights_of(reward)
    scored = []
    for index, group in enumerate(groups):
        parts = {name: values[index] for name, values in per_part.items()}
        rewards = combine(parts, weights)
        check_bounds(group.group_id, rewards, parts, reward.max_abs_reward)
        scored.append(
            advance(
                group,
                ScoredGroup,
                rewards=rewards,
                reward_parts=parts,
                config_version=config_version,
            )
        )
    return scored


async def main(cfg: RunConfig, stop: asyncio.Event) -> None:
    started = Stopwatch()
    bus = await Bus(cfg, "reward").connect()
    server, address = await start_grpc_server(cfg, cfg.service.grpc_port)
    live, presence = await join_run(cfg, bus, "reward", grpc=address)
    # The model and the remote service are set at start (the service's token file is read before each batch); the
    # functions and their weights are live.
    seed = cfg.train.seed if cfg.train.deterministic else None
    sources = RewardSources.of(cfg.reward, cfg.service.threads_for("reward"), seed)
    await asyncio.to_thread(sources.rules.start)  # the child's imports now, not in the first batch's time

    async def compute(groups: list[RolloutGroup]) -> list[ScoredGroup]:
        await live.refresh()  # reward weights are live
        reward = live.cfg.reward.model_copy(update={"model": cfg.reward.model, "http": cfg.reward.http})
        return await score_groups(groups, reward, sources, live.version)

    stage = Stage(bus, ROLLOUTS, SCORED, RolloutGroup, compute, cfg.reward.batch, "reward")
    await announce_ready(
        presence,
        grpc=address,
        metrics_url=current_telemetry().metrics_url,
        functions={**live.cfg.reward.functions},
        model=str(cfg.reward.model.path) if cfg.reward.model else None,
        http=cfg.reward.http.url if cfg.reward.http else None,
        config_version=live.version,
        startup_s=started(),
    )
    try:
        await serve_stage(stage, stop, server, presence)
    finally:
        sources.close()
