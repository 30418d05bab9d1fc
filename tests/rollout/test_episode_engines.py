"""Episodes through the real engines and the tiny model: every turn continues the exact tokens
recorded so far, and the recorded logprobs are the policy's own on those tokens."""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from services.common.episodes.environments import StepResult, Task, Turn
from services.common.episodes.runner import EpisodeRunner
from services.common.model.modeling import load_model
from services.common.transport.messages import Prompt, RolloutGroup, decode, encode
from services.rollout.engines import Engine, build_engine
from tests.support.messages import prompt
from tests.support.runs import run_config

pytestmark = pytest.mark.integration

OBSERVATION = "+1="


class AddOne:
    """Answers every turn with ``+1=`` until the turn budget ends the episode."""

    def reset(self, task: Task) -> str:
        return task.prompt

    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation=OBSERVATION, tool_call=True)


def run_episodes(tiny_model, tmp_path, backend: str) -> tuple[RolloutGroup, Engine, EpisodeRunner]:
    rollout = {
        "backend": backend,
        "kv_cache_mib": 48,
        "environment": f"{__name__}:AddOne",
        "max_turns": 3,
        "max_tokens_per_turn": 2,
        "max_total_tokens": 20,
    }
    cfg = run_config(tmp_path, tiny_model, rollout=rollout)
    engine_thread = ThreadPoolExecutor(max_workers=1)
    engine = engine_thread.submit(build_engine, cfg).result()

    async def on_engine(call, *args):
        return await asyncio.get_running_loop().run_in_executor(engine_thread, call, *args)

    runner = EpisodeRunner(cfg, engine.tokenizer, on_engine, engine.generate_turns, engine.end_tokens)
    asked = prompt("g0", prompt_id="p0", prompt="12+34=", answer="46")
    [group] = asyncio.run(runner.groups([asked], cfg.sampling.model_copy(update={"group_size": 2}), 0, 0))
    return group, engine, runner


# The engines compute logprobs with their own kernels: transformers' match a forward pass to float32 rounding.
@pytest.mark.parametrize(("backend", "tolerance"), [("hf", 1e-4), ("vllm", 2e-2)])
def test_episodes_on_the_tiny_model_record_the_policys_own_logprobs_on_its_tokens_only(
    tiny_model, tmp_path, backend, tolerance
):
    group, engine, runner = run_episodes(tiny_model, tmp_path, backend)
    observation = engine.tokenizer.encode(OBSERVATION, add_special_tokens=False)
    model = load_model(tiny_model[0], "float32").eval()
    assert len(group.completions) == 2
    for completion in group.completions:
        ids, mask, episode = completion.token_ids.tolist(), completion.loss_mask.tolist(), completion.episode
        runs = [list(run) for _, run in itertools.groupby(zip(mask, ids, strict=True), key=lambda pair: pair[0])]
        # Model turn, observation, model turn, ...: each turn at most max_tokens_per_turn; every observation the
        # environment's exact tokens, after every turn but the last.
        assert [run[0][0] for run in runs] == [1, 0] * (episode.turns - 1) + [1]
        assert all(len(run) <= 2 for run in runs[::2])
        assert all([token for _, token in run] == observation for run in runs[1::2])
        ended_on_eos = ids[-1] == engine.tokenizer.eos_token_id
        assert episode.outcome == ("done" if ended_on_eos else "max_turns")
        assert episode.tool_calls == episode.turns
        # The policy scores the whole recorded sequence: on the model's tokens, the sampled logprobs are its own.
        sequence = torch.tensor([group.prompt_ids.tolist() + completion.token_ids.tolist()])
        with torch.no_grad():
            logprobs = model(sequence).logits[0, :-1].log_softmax(-1)
        targets = sequence[0, 1:]
        policy = logprobs.gather(-1, targets[:, None])[:, 0].numpy()[len(group.prompt_ids) - 1 :]
        on_model = completion.loss_mask == 1
        np.testing.assert_allclose(completion.logprobs[on_model], policy[on_model], atol=tolerance)
        assert (completion.logprobs[~on_model] == 0).all()
    wire = decode(encode(group), RolloutGroup)  # what the reward role receives
    assert [c.loss_mask.tolist() for c in wire.completions] == [c.loss_mask.tolist() for c in group.completions]
    assert [c.episode for c in wire.completions] == [c.episode for c in group.completions]
    # Seeded: at two tokens a turn the tiny model never reaches its EOS, so both episodes use every turn.
    assert runner.metrics.outcomes == {"max_turns": 2}


def test_a_deterministic_groups_episodes_on_vllm_are_the_same_alone_and_sharing_each_turns_call(tiny_model, tmp_path):
    rollout = {
        "kv_cache_mib": 48,
        "environment": f"{__name__}:AddOne",
        "max_turns": 3,
        "max_tokens_per_turn": 2,
        "max_total_tokens": 20,
    }
    cfg = run_config(tmp_path, tiny_model, rollout=rollout, train={"deterministic": True, "synchronous": True})
    engine_thread = ThreadPoolExecutor(max_workers=1)
    engine = engine_thread.submit(build_engine, cfg).result()

    async def on_engine(call, *args):
        return await asyncio.get_running_loop().run_in_executor(engine_thread, call, *args)

    runner = EpisodeRunner(cfg, engine.tokenizer, on_engine, engine.generate_turns, engine.end_tokens)
    sampling = cfg.sampling.model_copy(update={"group_size": 3})
    ours = prompt("e0-i5", prompt_id="p5", prompt="12+34=", answer="46")
    other = prompt("e0-i6", prompt_id="p6", prompt="7+8=", answer="15")

    def episodes(prompts: list[Prompt]) -> list[tuple[list[int], list[float]]]:
        groups = asyncio.run(runner.groups(prompts, sampling, 0, 0))
        [group] = [g for g in groups if g.group_id == ours.group_id]
        return [(c.token_ids.tolist(), c.logprobs.tolist()) for c in group.completions]

    alone = episodes([ours])
    assert episodes([other, ours]) == alone
    assert len(set(map(str, alone))) > 1  # each episode its own draws, not one episode three times
