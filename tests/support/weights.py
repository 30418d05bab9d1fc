"""Weights from a trainer to an engine as the run moves them: a WeightSyncServer on a real gRPC port, a rollout's
PolicyFollower pulling from it into a running engine, and how each side scores the same sequences afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch

from services.common.model.modeling import load_model, pack, response_logits, token_logprobs
from services.common.pb import weights_pb2_grpc
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import Snapshot
from services.rollout.engines import Engine, VllmEngine
from services.rollout.follower import PolicyFollower
from tests.support.servers import free_port


async def serve_weights(weights: WeightSyncServer) -> tuple[grpc.aio.Server, str]:
    """``weights`` served on a free local gRPC port, started: (the server, its address)."""
    server = grpc.aio.server()
    weights_pb2_grpc.add_WeightSyncServicer_to_server(weights, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def sync_over_grpc(engine: Engine, engine_thread: ThreadPoolExecutor, snapshot: Snapshot) -> int:
    """Serve ``snapshot`` and sync ``engine`` to it; returns the version the follower loaded."""
    server, address = await serve_weights(WeightSyncServer(snapshot))
    follower = PolicyFollower(engine, engine_thread, WeightSyncClient(address))
    try:
        follower.newest = (await follower.client.version()).version
        await follower.sync()
        assert not follower.torn
        return follower.loaded
    finally:
        await follower.client.close()
        await server.stop(0)


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


def moved_policy(model_dir: Path, seed: int) -> torch.nn.Module:
    """The base model moved away from what vLLM loaded: a trained policy."""
    model = load_model(model_dir).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def trainer_logprobs(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]], pad_id: int) -> list[np.ndarray]:
    with torch.no_grad():
        batch = pack(pairs, pad_id)
        logprobs = token_logprobs(response_logits(model, batch), batch.targets)
    return [row[: len(r)].numpy() for row, (_, r) in zip(logprobs, pairs, strict=True)]


def wire_bytes(snapshot: Snapshot) -> int:
    """What one pull of ``snapshot`` carries as stored: every tensor once, tied ones included."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for _, t in snapshot.tensors}.values())
