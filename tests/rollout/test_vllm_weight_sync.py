"""After a sync over real gRPC, vLLM scores sequences like the trainer's transformers model with the same weights:
the newest version, streamed into the running engine, tied embeddings sent once and re-named on arrival."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch

from services.common.config import load_config
from services.common.modeling import load_model, load_tokenizer, pack, response_logits, token_logprobs
from services.common.pb import weights_pb2_grpc
from services.common.weightsync import WeightSyncClient, WeightSyncServer, snapshot_of
from services.rollout.engines import VllmEngine
from services.rollout.service import PolicyFollower
from tests.conftest import free_port, write_config

PAIRS = [("37+45=", "82"), ("9+9=", "18"), ("50+50=", "100"), ("3+4=", "7")]


def vllm_response_logprobs(engine: VllmEngine, pairs: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p + r) for p, r in pairs]
    outputs = engine.llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    scored = []
    for (prompt, response), out in zip(pairs, outputs, strict=False):
        per_position = out.prompt_logprobs  # first entry is None: nothing predicts the first token
        scored.append(np.array([per_position[len(prompt) + j][token].logprob for j, token in enumerate(response)]))
    return scored


def test_vllm_logprobs_match_trainer_after_sync(tiny_model, tmp_path):
    model_dir, data_dir = tiny_model
    cfg = load_config(write_config(tmp_path / "c.yaml", model_dir, data_dir, tmp_path / "runs"))
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    pairs = [
        (tokenizer.encode(p, add_special_tokens=False), [*tokenizer.encode(r, add_special_tokens=False), eos])
        for p, r in PAIRS
    ]

    # The "trainer" policy: the base model moved away from what vLLM loaded.
    policy = load_model(model_dir).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
        batch = pack(pairs, tokenizer.pad_token_id)
        expected = token_logprobs(response_logits(policy, batch), batch.targets)
    expected = [row[: len(r)].numpy() for row, (_, r) in zip(expected, pairs, strict=False)]

    engine_thread = ThreadPoolExecutor(max_workers=1)
    engine = engine_thread.submit(VllmEngine, cfg).result()

    def max_gap() -> float:
        got = engine_thread.submit(vllm_response_logprobs, engine, pairs).result()
        return max(float(np.abs(g - e).max()) for g, e in zip(got, expected, strict=False))

    before = max_gap()

    def other_policy(seed: int) -> torch.nn.Module:
        model = load_model(model_dir).eval()
        torch.manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        return model

    async def sync_over_grpc() -> int:
        # The replica is behind: versions 5 and 6 went by unseen; only 7 (the policy) may end up loaded.
        weights = WeightSyncServer(snapshot_of(other_policy(5), version=5, step=5))
        server = grpc.aio.server()
        weights_pb2_grpc.add_WeightSyncServicer_to_server(weights, server)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await server.start()
        await weights.publish(snapshot_of(other_policy(6), version=6, step=6))
        await weights.publish(snapshot_of(policy, version=7, step=7))
        follower = PolicyFollower(engine, engine_thread, WeightSyncClient(f"127.0.0.1:{port}"))
        follower.newest = (await follower.client.version()).version
        await follower.sync()
        assert not follower.torn
        await follower.client.close()
        await server.stop(0)
        return follower.loaded

    assert asyncio.run(sync_over_grpc()) == 7
    after = max_gap()
    assert before > 1e-2, f"perturbed weights should score differently before the sync (gap {before})"
    assert after < 1e-3, f"after the sync vLLM and transformers differ by {after}"
