"""After a sync over real gRPC, vLLM scores sequences like the trainer's transformers model with the same weights:
the newest version, streamed into the running engine, tied embeddings sent once and re-named on arrival, after a
replica that fell behind skipped the versions in between."""

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from services.common.model.modeling import load_tokenizer
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import snapshot_of
from services.common.transport.weightsync.wire import dtype_named
from services.rollout.engines import VllmEngine, serving_dtype
from services.rollout.follower import PolicyFollower
from tests.support.runs import run_config
from tests.support.waits import until
from tests.support.weights import (
    PAIRS,
    moved_policy,
    serve_weights,
    trainer_logprobs,
    vllm_response_logprobs,
    wire_bytes,
)

pytestmark = pytest.mark.integration


def test_vllm_logprobs_match_trainer_after_sync(tiny_model, tmp_path):
    """Latest wins: a replica that loaded version 5 and fell behind while 6 and 7 were published catches up
    to 7 in one pull, skipping 6, and then scores as the trainer's version 7 does."""
    model_dir, _ = tiny_model
    cfg = run_config(tmp_path, tiny_model)
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    pairs = [
        (tokenizer.encode(p, add_special_tokens=False), [*tokenizer.encode(r, add_special_tokens=False), eos])
        for p, r in PAIRS
    ]

    policy = moved_policy(model_dir, seed=0)  # the trainer's newest, version 7
    expected = trainer_logprobs(policy, pairs, tokenizer.pad_token_id)

    engine_thread = ThreadPoolExecutor(max_workers=1)
    engine = engine_thread.submit(VllmEngine, cfg).result()

    def max_gap(want: list[np.ndarray]) -> float:
        got = engine_thread.submit(vllm_response_logprobs, engine, pairs).result()
        return max(float(np.abs(g - e).max()) for g, e in zip(got, want, strict=False))

    before = max_gap(expected)
    older = moved_policy(model_dir, seed=5)
    older_expected = trainer_logprobs(older, pairs, tokenizer.pad_token_id)
    snapshots = {
        5: snapshot_of(older, version=5, step=5),
        6: snapshot_of(moved_policy(model_dir, seed=6), version=6, step=6),
        7: snapshot_of(policy, version=7, step=7),
    }

    async def follow_over_grpc() -> dict:
        # The replica follows the trainer through its watch stream, as a rollout does, and loads version 5.
        weights = WeightSyncServer(snapshots[5])
        server, address = await serve_weights(weights)
        follower = PolicyFollower(engine, engine_thread, WeightSyncClient(address))
        watcher = asyncio.create_task(follower.watch())
        try:
            await until(lambda: follower.newest == 5)
            await follower.sync()
            seen = {"first": follower.loaded, "gap_first": await asyncio.to_thread(max_gap, older_expected)}
            # Then it falls behind: 6 and 7 are published while it is busy, and it never loads 6.
            await weights.publish(snapshots[6])
            await weights.publish(snapshots[7])
            await until(lambda: follower.newest == 7)
            seen["gap_behind"] = await asyncio.to_thread(max_gap, expected)
            sent = weights.sent_bytes
            await follower.sync()  # one sync: straight to the newest
            seen.update(loaded=follower.loaded, torn=follower.torn, trainer_sent=weights.sent_bytes - sent)
            return seen
        finally:
            watcher.cancel()
            await follower.close()
            await server.stop(0)

    seen = asyncio.run(follow_over_grpc())
    after = max_gap(expected)
    assert before > 1e-2, f"perturbed weights should score differently before the sync (gap {before})"
    assert seen["first"] == 5 and seen["gap_first"] < 1e-3, f"version 5 loaded scores {seen['gap_first']} off"
    assert seen["gap_behind"] > 1e-2, "version 5 must score differently from version 7"
    assert (seen["loaded"], seen["torn"]) == (7, False)
    # Skipped, not replayed: the catch-up pulled one copy of the model (version 7), not version 6 and then 7.
    assert seen["trainer_sent"] == wire_bytes(snapshots[7])
    assert after < 1e-3, f"after the sync vLLM and transformers differ by {after}"


def test_a_bfloat16_rollout_pulls_half_the_bytes_and_then_scores_as_one_started_from_the_policy(tiny_model, tmp_path):
    """A float32 trainer, a rollout serving bfloat16 (rollout.dtype): the rollout pulls in the dtype it serves, as
    its service does (serving_dtype), so half the bytes cross the wire, and after the update it scores exactly as
    a bfloat16 engine started from the trainer's policy does. (Against the trainer's own transformers forward in
    bfloat16 it differs by ~2e-2: the two sum bfloat16 products in different orders; float32 is held to 1e-3
    by the test above.)"""
    model_dir, _ = tiny_model
    cfg = run_config(tmp_path, tiny_model, rollout={"dtype": "bfloat16"})
    assert cfg.model.dtype == "float32" and serving_dtype(cfg.model, cfg.rollout) == "bfloat16"
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    pairs = [
        (tokenizer.encode(p, add_special_tokens=False), [*tokenizer.encode(r, add_special_tokens=False), eos])
        for p, r in PAIRS
    ]
    policy = moved_policy(model_dir, seed=0)  # float32, as the trainer holds it
    snapshot = snapshot_of(policy, version=3, step=3)
    assert all(t.dtype == torch.float32 for _, t in snapshot.tensors)
    policy_dir = tmp_path / "policy"
    shutil.copytree(model_dir, policy_dir)
    policy.save_pretrained(policy_dir)  # the trainer's policy on disk, in float32

    engine_thread = ThreadPoolExecutor(max_workers=1)
    engine = engine_thread.submit(VllmEngine, cfg).result()
    assert engine.llm.llm_engine.vllm_config.model_config.dtype == torch.bfloat16
    fresh_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": policy_dir})})
    fresh = engine_thread.submit(VllmEngine, fresh_cfg).result()  # a bfloat16 engine started from the policy
    expected = engine_thread.submit(vllm_response_logprobs, fresh, pairs).result()

    def max_gap() -> float:
        got = engine_thread.submit(vllm_response_logprobs, engine, pairs).result()
        return max(float(np.abs(g - e).max()) for g, e in zip(got, expected, strict=True))

    async def sync() -> tuple[int, int]:
        weights = WeightSyncServer(snapshot)
        server, address = await serve_weights(weights)
        client = WeightSyncClient(address)
        follower = PolicyFollower(
            engine, engine_thread, client, dtype=dtype_named(serving_dtype(cfg.model, cfg.rollout))
        )
        try:
            follower.newest = (await client.version()).version
            await follower.sync()
            assert not follower.torn
            return follower.loaded, weights.sent_bytes
        finally:
            await follower.close()
            await server.stop(0)

    before = max_gap()
    loaded, sent = asyncio.run(sync())
    after = max_gap()
    assert loaded == 3
    assert sent * 2 == wire_bytes(snapshot)  # bfloat16 on the wire: half the float32 bytes, tied weights once
    assert before > 1e-2, f"perturbed weights should score differently before the sync (gap {before})"
    assert after < 1e-3, f"after the sync vLLM scores {after} off an engine started from the same weights"
