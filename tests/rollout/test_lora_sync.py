"""With model.lora a policy version is its adapter alone: synced over real gRPC into vLLM (hot-loaded as a LoRA
adapter, or merged into the base) or the hf engine (merged), after which the rollout scores responses as the
trainer's peft policy does; a second version replaces the first rather than adding to it."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from services.common.model.modeling import load_tokenizer
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.server import WeightSyncServer
from services.rollout.engines import HfEngine, VllmEngine, build_engine
from services.rollout.follower import PolicyFollower
from services.trainer.learning.learner import Learner
from tests.support.runs import run_config
from tests.support.waits import until
from tests.support.weights import PAIRS, serve_weights, trainer_logprobs, wire_bytes

pytestmark = pytest.mark.integration

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def engine_logprobs(engine, pairs: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """The engine's logprob of each response token, under the adapter it serves."""
    if isinstance(engine, HfEngine):
        return trainer_logprobs(engine.model, pairs, engine.tokenizer.pad_token_id)
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p + r) for p, r in pairs]
    outputs = engine.llm.generate(
        prompts,
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
        lora_request=engine.lora_request,
    )
    return [
        np.array([out.prompt_logprobs[len(p) + j][t].logprob for j, t in enumerate(r)])
        for (p, r), out in zip(pairs, outputs, strict=True)
    ]


def train_adapters(learner: Learner, seed: int) -> None:
    """Adapters as training leaves them: B (zero at the start) and A moved."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in learner.model.named_parameters():
            if param.requires_grad:
                param.add_((0.3 if ".lora_B." in name else 0.05) * torch.randn_like(param))


@pytest.mark.parametrize(
    ("backend", "mode", "served"), [("vllm", "auto", "adapter"), ("vllm", "merge", "merge"), ("hf", "auto", "merge")]
)
def test_an_adapter_only_sync_makes_the_rollout_score_as_the_trainers_lora_policy(
    tiny_model, tmp_path, backend, mode, served
):
    model_dir, _ = tiny_model
    cfg = run_config(tmp_path, tiny_model, model={"lora": LORA}, rollout={"backend": backend, "lora": mode})
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    pairs = [
        (tokenizer.encode(p, add_special_tokens=False), [*tokenizer.encode(r, add_special_tokens=False), eos])
        for p, r in PAIRS
    ]
    learner = Learner(cfg)
    learner.model.eval()
    snapshots, expected = {}, {}
    for version in (1, 2):
        train_adapters(learner, seed=version)
        snapshots[version] = learner.snapshot(version=version, step=version)
        expected[version] = trainer_logprobs(learner.model, pairs, tokenizer.pad_token_id)

    engine_thread = ThreadPoolExecutor(max_workers=1)
    engine = engine_thread.submit(build_engine, cfg).result()
    assert engine.lora_mode == served
    assert isinstance(engine, VllmEngine if backend == "vllm" else HfEngine)

    def gap(version: int) -> float:
        got = engine_thread.submit(engine_logprobs, engine, pairs).result()
        return max(float(np.abs(g - e).max()) for g, e in zip(got, expected[version], strict=True))

    async def follow() -> dict[str, float]:
        weights = WeightSyncServer(snapshots[1])
        server, address = await serve_weights(weights)
        follower = PolicyFollower(engine, engine_thread, WeightSyncClient(address))
        watcher = asyncio.create_task(follower.watch())
        try:
            seen = {"before": await asyncio.to_thread(gap, 1)}
            await until(lambda: follower.newest == 1)
            await follower.sync()
            seen["first"] = await asyncio.to_thread(gap, 1)
            await weights.publish(snapshots[2])
            await until(lambda: follower.newest == 2)
            sent = weights.sent_bytes
            await follower.sync()
            seen |= {"second": await asyncio.to_thread(gap, 2), "sent": weights.sent_bytes - sent}
            seen["loaded"] = follower.loaded
            return seen
        finally:
            watcher.cancel()
            await follower.close()
            await server.stop(0)

    seen = asyncio.run(follow())
    assert seen["before"] > 1e-2, f"the trained adapter should score differently from the base ({seen['before']})"
    assert seen["first"] < 1e-3, f"after version 1 the rollout scores {seen['first']} off the trainer"
    # Merged onto the kept base, not onto version 1's merge; hot-loaded in place of version 1's adapter.
    assert seen["second"] < 1e-3, f"after version 2 the rollout scores {seen['second']} off the trainer"
    assert seen["loaded"] == 2
    # Only the adapter crossed the wire: 3 layers x 3 modules x (A, B).
    assert len(snapshots[2].tensors) == 3 * 3 * 2
    assert seen["sent"] == wire_bytes(snapshots[2])
