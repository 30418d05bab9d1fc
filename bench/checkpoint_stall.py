"""The stall a checkpoint save adds to a training step, against the step itself.

A save holds the training step only while ``Checkpointer.snapshot`` copies the state to host memory
(``checkpoint_stall_s`` in the metrics; the copies run on a worker thread, so the event loop that renews the lease
is not held); encoding and uploading that copy runs on a worker thread while training goes on. This times the
snapshot's copies with the trainer's own functions (``detached_copy``, ``host_copy``, ``in_saved_dtype``) for the
three kinds of save, the background encode and write to a file:// store, and, for scale, a training step (forward,
backward, AdamW) of the same model on the same device.

    python -m bench.checkpoint_stall [--batch 8 --tokens 256]    # SmolLM2-135M's shape, random weights
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.weight_sync import smollm2_135m
from services.common.config import CheckpointConfig
from services.common.model.modeling import host_copy
from services.common.transport.storage import open_store
from services.trainer.checkpointing.checkpointer import in_saved_dtype
from services.trainer.checkpointing.state import Checkpoint, TrainerState, detached_copy, rng_state
from services.trainer.checkpointing.store import CheckpointStore


def median_s(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="sequences per training step")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = smollm2_135m()
    # float32 master weights, as the trainer's. (transformers' functools.wraps(Module.to) loses the bound self's type.)
    model.to(device)  # pyright: ignore[reportArgumentType]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), device=device)

    def step() -> None:
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    step()  # AdamW's moments exist from here, as in a run's saves
    params = sum(p.numel() for p in model.parameters())
    print(f"model: SmolLM2-135M shape, {params / 1e6:.1f} M parameters, {device}", flush=True)
    step_s = median_s(step, args.repeats)
    print(f"training step (batch {args.batch} x {args.tokens} tokens): {step_s * 1000:.0f} ms", flush=True)
    for name, snapshot in (
        ("stall, full save (weights + optimizer)", lambda: (detached_copy(model), host_copy(optimizer.state_dict()))),
        ("stall, weights only (optimizer_every > 1)", lambda: detached_copy(model)),
        (
            "stall, weights only in bfloat16 (serving)",
            lambda: in_saved_dtype(detached_copy(model), "serving", "bfloat16"),
        ),
    ):
        seconds = median_s(snapshot, args.repeats)
        print(f"{name}: {seconds * 1000:.0f} ms, {100 * seconds / step_s:.1f} % of a step", flush=True)

    ckpt = Checkpoint(
        1,
        detached_copy(model),
        host_copy(optimizer.state_dict()),
        {"last_epoch": 1},
        rng_state(),
        TrainerState(step=1, policy_version=1, last_experience_seq=0, incarnation="bench"),
    )
    with tempfile.TemporaryDirectory() as folder:
        store = CheckpointStore(open_store(Path(folder).as_uri(), CheckpointConfig()), "bench", keep_last=1)
        store.start_fresh("bench")
        started = time.perf_counter()
        store.save(ckpt, Path(folder))
        print(f"off the loop: encode + write a full save to file://: {(time.perf_counter() - started) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
