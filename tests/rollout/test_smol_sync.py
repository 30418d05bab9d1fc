"""SmolLM2-135M-Instruct (the pretrained model `make model-smol` imports) through weight sync and the reference:
after a trainer's moved weights are synced over real gRPC into a running vLLM engine, vLLM scores chat-rendered
prompts' answers as the trainer does, while the reference service still scores them as the unmoved model."""

import asyncio
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.model.chat import prompt_text
from services.common.model.datasets import load_jsonl
from services.common.model.modeling import load_model, load_tokenizer, pack, response_logits, token_logprobs
from services.common.transport.messages import Completion, Prompt, RolloutGroup, ScoredGroup, advance
from services.common.transport.weightsync.snapshot import snapshot_of
from services.reference.service import ReferenceScorer
from services.rollout.engines import VllmEngine
from tests.support.paths import ROOT
from tests.support.runs import run_config
from tests.support.weights import sync_over_grpc, vllm_response_logprobs

pytestmark = pytest.mark.e2e

SMOL_DIR, SMOL_DATA = ROOT / "models" / "smollm2-135m-instruct", ROOT / "data" / "word-problems"
# float32 on the CPU: two kernels (vLLM's and transformers', or one batched two ways) sum in different orders over 30
# layers (1.2e-5 seen).
TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def smol_model() -> tuple[Path, Path]:
    """The imported model and its word problems, built by `make model-smol` when missing (a minute or two)."""
    if not (SMOL_DIR / "gguf_import.json").is_file() or not (SMOL_DATA / "eval.jsonl").is_file():
        subprocess.run(["make", "model-smol"], cwd=ROOT, check=True, timeout=1200)
    return SMOL_DIR, SMOL_DATA


def moved(model: torch.nn.Module, seed: int) -> None:
    """Move ``model`` in place by noise of 5% of each tensor's spread: a policy trained away from the base."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * param.std() * torch.randn_like(param))


def scored(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]], pad_id: int) -> list[np.ndarray]:
    with torch.no_grad():
        batch = pack(pairs, pad_id)
        logprobs = token_logprobs(response_logits(model, batch), batch.targets)
    return [row[: len(response)].numpy() for row, (_, response) in zip(logprobs, pairs, strict=True)]


def gap(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))


@pytest.mark.e2e
def test_smol_weights_synced_into_vllm_score_like_the_trainer_and_the_reference_keeps_the_base(smol_model, tmp_path):
    model_dir, data_dir = smol_model
    cfg = run_config(tmp_path, smol_model, train={"max_seq_len": 128})
    tokenizer = load_tokenizer(model_dir)
    rows = load_jsonl(data_dir / "eval.jsonl")[:2]
    assert all("messages" in row for row in rows)
    pairs = [
        (
            tokenizer.encode(prompt_text(row, tokenizer), add_special_tokens=False),
            [*tokenizer.encode(f"The answer is {row['answer']}.", add_special_tokens=False), tokenizer.eos_token_id],
        )
        for row in rows
    ]
    assert tokenizer.decode(pairs[0][0]).endswith("<|im_start|>assistant\n")  # the chat template rendered it

    policy = load_model(model_dir).eval()  # the trainer's
    base_logprobs = scored(policy, pairs, tokenizer.pad_token_id)
    moved(policy, seed=0)
    policy_logprobs = scored(policy, pairs, tokenizer.pad_token_id)
    assert gap(policy_logprobs, base_logprobs) > 0.05, "the moved policy must score differently from the base"

    engine_thread = ThreadPoolExecutor(max_workers=1)
    engine = engine_thread.submit(VllmEngine, cfg).result()

    def vllm_logprobs() -> list[np.ndarray]:
        return engine_thread.submit(vllm_response_logprobs, engine, pairs).result()

    assert gap(vllm_logprobs(), base_logprobs) < TOLERANCE  # vLLM serves the imported model as transformers does

    assert asyncio.run(sync_over_grpc(engine, engine_thread, snapshot_of(policy, version=1, step=1))) == 1
    assert gap(vllm_logprobs(), policy_logprobs) < TOLERANCE

    groups = []
    for row, (prompt_ids, response) in zip(rows, pairs, strict=True):
        rollout = advance(
            Prompt(group_id=row["id"], prompt_id=row["id"], prompt=prompt_text(row, tokenizer)),
            RolloutGroup,
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            policy_version=1,
            completions=[
                Completion(
                    text=tokenizer.decode(response),
                    token_ids=np.asarray(response, dtype=np.int32),
                    logprobs=np.zeros(len(response), dtype=np.float32),
                    finish_reason="stop",
                )
            ],
        )
        groups.append(advance(rollout, ScoredGroup, rewards=np.ones(1, dtype=np.float32)))
    reference = [group.ref_logprobs[0] for group in ReferenceScorer(cfg)(groups)]
    # Its own batches and threads sum in another order than `scored` (1.1e-5 seen in CI): float32's noise, far below
    # the policy's move.
    assert gap(reference, base_logprobs) < TOLERANCE
    assert gap(reference, policy_logprobs) > 0.05
