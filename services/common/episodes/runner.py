"""Multi-turn episodes: many at once through the engine, each kept as token ids with logprobs and a loss mask.

Each turn, one engine call continues every episode that is ready (continuous batching); an episode whose
environment is still stepping waits outside the engine and joins the next call after it answers, so a slow tool
holds only its own episode. The call is shared across the batches a replica has in hand
(``rollout.episode_batches``, the rollout stage's lanes): ``turns.TurnBatcher`` gathers the ready turns of all of
them, so a batch whose last episodes wait on their environment holds neither the engine nor the next batch.

Token in, token out: the model's tokens are kept exactly as sampled (loss mask 1, their sampling logprobs) and an
observation is tokenized once, alone, and appended (loss mask 0, logprob 0), verbatim or as a chat message
(``observations.py``); nothing earlier is ever re-tokenized.

An episode ends with a named outcome (``Episode.outcome``): ``done`` (the environment said so, or the model
ended its answer with an end token, ``Engine.end_tokens``, where that does not just end a chat message),
``max_turns``, ``max_tokens`` (no room left for another turn), ``truncated`` (an observation over
``rollout.max_observation_tokens`` or the room left), ``env_error`` (the environment raised or answered nonsense)
or ``timeout`` (a step past ``rollout.environment_timeout_s``). None of them fails the group: the environment's
fault is the episode's outcome, counted in the metrics, and the completion is trained on as it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from services.common.config import RunConfig, SamplingConfig
from services.common.episodes.environments import EnvironmentFailed, Task, Turn
from services.common.episodes.episode_environment import EpisodeEnvironment, environment_maker
from services.common.episodes.episode_metrics import EpisodeMetrics
from services.common.episodes.episode_state import EpisodeLimits, EpisodeState
from services.common.episodes.generation import Generation
from services.common.episodes.observations import ObservationFormat, Tokenizer, observation_format
from services.common.episodes.turns import TurnBatcher
from services.common.observe.events import Event
from services.common.observe.logs import log_event
from services.common.refusal import StartRefused
from services.common.seeding import sampling_seed
from services.common.transport.breaker import DependencyRefused, DependencyUnavailable
from services.common.transport.messages import Prompt, RolloutGroup, advance

log = logging.getLogger(__name__)

# (contexts, max new tokens for each[, each one's seed]) -> one turn each: the engine call, on the engine's thread.
# The seeds come only from a run_episodes given a run seed.
TurnGenerator = Callable[..., Awaitable[list[Generation]]]


async def start_episodes(
    tasks: list[Task], make_environment: Callable[[], EpisodeEnvironment], samples: int, tokenizer: Tokenizer
) -> list[list[EpisodeState]]:
    """``samples`` episodes per task, each with an environment of its own, reset. All of a group's episodes start
    from one prompt (the group's ``prompt_ids``): their resets must agree. A reset that fails, or disagrees, holds
    the batch (DependencyUnavailable; DependencyRefused when the environment refuses us, which alerts at once): no
    episode has run yet, and the prompts are not at fault."""

    async def reset(task: Task) -> tuple[EpisodeEnvironment, str, float]:
        environment = make_environment()
        started = time.perf_counter()
        try:
            text = await environment.reset(task)
        except EnvironmentFailed as error:
            log_event(log, Event.ENVIRONMENT_RESET_FAILED, level=logging.ERROR, alert=True, error=str(error))
            reason = f"the environment's reset failed ({error.outcome}): {error}"
            if error.refused:
                raise DependencyRefused(error.refused, reason) from error
            raise DependencyUnavailable(reason) from error
        return environment, text, time.perf_counter() - started

    outcomes = await asyncio.gather(*(reset(task) for task in tasks for _ in range(samples)), return_exceptions=True)
    resets = [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
    failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    if failed:  # the batch is held: the episodes that did reset are over before they began
        await asyncio.gather(*(environment.close() for environment, _, _ in resets))
        raise failed[0]
    groups = []
    for index, task in enumerate(tasks):
        group = resets[index * samples : (index + 1) * samples]
        texts = {text for _, text, _ in group}
        if len(texts) != 1:
            await asyncio.gather(*(environment.close() for environment, _, _ in resets))
            raise DependencyUnavailable(f"the environment's resets of prompt {task.prompt_id!r} gave different prompts")
        prompt_ids = tokenizer.encode(texts.pop(), add_special_tokens=False)
        groups.append(
            [
                EpisodeState(environment=env, context=list(prompt_ids), prompt_len=len(prompt_ids), env_seconds=s)
                for env, _, s in group
            ]
        )
    return groups


async def run_episodes(
    episodes: list[EpisodeState],
    generate: TurnGenerator,
    limits: EpisodeLimits,
    tokenizer: Tokenizer,
    observations: ObservationFormat,
    end_tokens: frozenset[int] | None = None,
    run_seed: int | None = None,
) -> None:
    """Run every episode to its end (each gets an ``outcome``), observations appended as ``observations`` says.
    ``end_tokens``: what the engine ends a generation on (``Engine.end_tokens``; default the tokenizer's EOS),
    read as the model ending its message. A prompt that leaves no room for a first turn is the prompt's fault:
    ValueError, as in single-turn generation. ``run_seed`` (train.deterministic): each turn is drawn with the seed
    ``sampling_seed(run_seed, group id, index, turn)`` of its episode's ``sample``, passed to ``generate`` as a
    third argument; None: ``generate`` gets two."""
    eos = tokenizer.eos_token_id
    ends = end_tokens if end_tokens is not None else frozenset(() if eos is None else (eos,))
    for episode in episodes:
        if limits.max_seq_len - episode.prompt_len < 1:
            raise ValueError(f"prompt of {episode.prompt_len} tokens leaves no room under {limits.max_seq_len=}")
    ready = list(episodes)
    stepping: set[asyncio.Task[EpisodeState]] = set()
    try:
        while ready or stepping:
            if ready:
                turn_of, ready = ready, []
                contexts, rooms = [e.context for e in turn_of], [e.room(limits) for e in turn_of]
                if run_seed is None:
                    generations = await generate(contexts, rooms)
                else:
                    seeds = [sampling_seed(run_seed, *e.sample, e.turns) for e in turn_of]
                    generations = await generate(contexts, rooms, seeds)
                for episode, generation in zip(turn_of, generations, strict=True):
                    after = _after_turn(episode, generation, limits, ends, observations)
                    stepping.add(asyncio.create_task(after))
            finished, stepping = await asyncio.wait(stepping, return_when=asyncio.FIRST_COMPLETED)
            ready = [episode for task in finished if (episode := task.result()).outcome is None]
    finally:  # the engine failed (the batch is held and retried): no step of this batch may outlive it
        for task in stepping:
            task.cancel()
        # Ended by a budget, a failure or the model rather than by the environment, an episode is still held by an
        # environment service until it is told.
        await asyncio.gather(*(episode.environment.close() for episode in episodes))


async def _after_turn(
    episode: EpisodeState,
    generation: Generation,
    limits: EpisodeLimits,
    end_tokens: frozenset[int],
    observations: ObservationFormat,
) -> EpisodeState:
    """Record the model's turn, let the environment answer it, and either end the episode or append the answer."""
    ids = generation.token_ids.tolist()
    episode.context += ids
    episode.logprobs += generation.logprobs.tolist()
    episode.mask += [1] * len(ids)
    if generation.policy_version is not None:
        episode.versions += [generation.policy_version] * len(ids)
    episode.turns += 1
    ended_on_end_token = bool(ids) and ids[-1] in end_tokens  # any end token closes the message: no EOS added
    # The model ended its answer (nothing to continue), unless EOS ends a chat message only (observation_role).
    answered = not ids or (ended_on_end_token and observations.eos_ends_episode)
    started = time.perf_counter()
    try:
        result = await episode.environment.step(Turn(text=generation.text, token_ids=tuple(ids)))
    except EnvironmentFailed as error:
        episode.outcome = error.outcome
        log_event(log, Event.ENVIRONMENT_STEP_FAILED, level=logging.WARNING, outcome=error.outcome, error=str(error))
        return episode
    finally:
        episode.env_seconds += time.perf_counter() - started
    episode.tool_calls += result.tool_call
    episode.tool_errors += result.tool_error
    episode.env_reward += result.reward_part
    if result.done or answered:
        episode.outcome = "done"
    elif episode.turns >= limits.max_turns:
        episode.outcome = "max_turns"
    elif episode.room(limits) < 1:
        episode.outcome = "max_tokens"
    else:
        observation = observations.tokens(result.observation, ended_on_end_token)
        # The observation must leave the model room to answer it: one token at least.
        left = min(limits.max_total_tokens - episode.generated, limits.max_seq_len - len(episode.context))
        fits = min(limits.max_observation_tokens, left - 1)
        if len(observation) > fits:
            episode.outcome = "truncated"
            return episode
        episode.context += observation
        episode.logprobs += [0.0] * len(observation)
        episode.mask += [0] * len(observation)
        if generation.policy_version is not None:
            episode.versions += [generation.policy_version] * len(observation)
    return episode


class EpisodeRunner:
    """The rollout's multi-turn path: prompts in, one group of episodes per prompt out."""

    def __init__(
        self,
        cfg: RunConfig,
        tokenizer: Tokenizer,
        on_engine: Callable[..., Awaitable[list[Generation]]],
        generate_turns: Callable[..., list[Generation]],
        end_tokens: frozenset[int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.end_tokens = end_tokens
        self.limits = EpisodeLimits.of(cfg)
        stop = list(cfg.rollout.turn_stop)

        # train.deterministic: each turn drawn with a seed of its own (services/common/seeding.py).
        self.run_seed = cfg.train.seed if cfg.train.deterministic else None

        async def engine_turns(
            contexts: list[list[int]], max_tokens: list[int], sampling: SamplingConfig, seeds: list[int] | None = None
        ) -> list[Generation]:
            # on_engine runs the call on the engine's thread and judges its failures
            if seeds is None:  # an unseeded run: the engine's own random stream
                return await on_engine(generate_turns, contexts, max_tokens, sampling, stop)
            return await on_engine(generate_turns, contexts, max_tokens, sampling, stop, seeds)

        self.turns = TurnBatcher(engine_turns)
        self.metrics = EpisodeMetrics()
        self.make_environment = environment_maker(cfg.rollout)
        try:
            self.observations = observation_format(tokenizer, cfg.rollout.observation_role)
        except ValueError as error:  # the model cannot take this config: restarting would refuse alike
            raise StartRefused(str(error)) from None

    async def groups(
        self, prompts: list[Prompt], sampling: SamplingConfig, policy_version: int, config_version: int
    ) -> list[RolloutGroup]:
        tasks = [Task(prompt_id=p.prompt_id, prompt=p.prompt, answer=p.answer, info=p.info) for p in prompts]
        groups = await start_episodes(tasks, self.make_environment, sampling.group_size, self.tokenizer)
        for prompt, group in zip(prompts, groups, strict=True):
            for index, episode in enumerate(group):
                episode.sample = (prompt.group_id, index)

        async def generate(
            contexts: list[list[int]], max_tokens: list[int], seeds: list[int] | None = None
        ) -> list[Generation]:
            return await self.turns.generate(contexts, max_tokens, sampling, seeds)

        episodes = [episode for group in groups for episode in group]
        await run_episodes(
            episodes, generate, self.limits, self.tokenizer, self.observations, self.end_tokens, self.run_seed
        )
        for group in groups:
            self.metrics.record(group)
        # A group is tagged with the newest version that sampled a token of it (RolloutGroup.policy_version): its
        # turns may have run on several (in-flight updates, or another batch's sync between turns).
        versions = [
            max((v for e in group if (v := e.newest_version) is not None), default=policy_version) for group in groups
        ]
        return [
            advance(
                prompt,
                RolloutGroup,
                prompt_ids=np.asarray(group[0].context[: group[0].prompt_len], dtype=np.int32),
                policy_version=version,
                config_version=config_version,
                completions=[episode.completion(self.tokenizer, version) for episode in group],
            )
            for prompt, group, version in zip(prompts, groups, versions, strict=True)
        ]
