"""Weight sync per policy version, full weights against a LoRA adapter: bytes on the wire, the trainer's snapshot
seconds, the gRPC pull seconds, and (with ``--vllm``) the seconds vLLM takes to start serving the version.

The trainer side is what ``Learner.snapshot`` serves (``snapshot_of`` the model; with LoRA the adapter tensors under
peft's saved names), pulled over the real ``WeightSync`` gRPC service on loopback, in this process. Full weights
load into vLLM with ``reload_weights``; an adapter is hot-loaded as a LoRA adapter over the untouched base.

    python -m bench.lora_sync --model build/test-model/model
    python -m bench.lora_sync --model build/smollm2-135m-instruct --vllm
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import grpc
import torch

from services.common.config import LoraConfig, load_config
from services.common.model.lora import adapter_tensors, attach_adapters
from services.common.model.modeling import load_model
from services.common.pb import weights_pb2_grpc
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import Snapshot, snapshot_of


@dataclass(frozen=True)
class Row:
    what: str
    wire_bytes: int
    tensors: int
    snapshot_s: float  # the trainer's copy of a version
    pull_s: float  # median gRPC pull of it
    load_s: float | None = None  # vLLM serving it (reload_weights, or a LoRA hot-load)


def lora_snapshot(model: torch.nn.Module, version: int) -> Snapshot:
    """What ``Learner.snapshot`` serves with model.lora: copies of the adapter tensors, peft's saved names."""
    tensors = adapter_tensors(model.state_dict())
    return Snapshot(version, version, tuple((name, t.detach().clone()) for name, t in tensors.items()))


async def pull_seconds(snapshot: Snapshot, repeats: int) -> tuple[float, int]:
    server = grpc.aio.server()
    weights_pb2_grpc.add_WeightSyncServicer_to_server(WeightSyncServer(snapshot), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WeightSyncClient(f"127.0.0.1:{port}")
    times, data_bytes = [], 0
    try:
        for _ in range(repeats + 1):  # the first pull warms the channel and makes the version's CRCs
            started = time.perf_counter()
            stream = client.stream()
            async for _ in stream:
                pass
            times.append(time.perf_counter() - started)
            data_bytes = stream.data_bytes
    finally:
        await client.close()
        await server.stop(0)
    return statistics.median(times[1:]), data_bytes


def timed(make):
    started = time.perf_counter()
    value = make()
    return value, time.perf_counter() - started


def vllm_load_seconds(model_dir: str, snapshot: Snapshot, lora: LoraConfig | None) -> float:
    """Median seconds of three loads of ``snapshot`` into a running vLLM engine (the rollout's)."""
    from services.rollout.engines import VllmEngine

    cfg = load_config(
        None,
        model={"path": model_dir, **({"lora": lora.model_dump()} if lora else {})},
        data={"train_path": model_dir},  # not read: the engine needs only model and train.max_seq_len
        train={"max_seq_len": 64},
        rollout={"kv_cache_mib": 64},
    )
    engine = VllmEngine(cfg)
    times = [timed(lambda: engine.load_weights(iter(snapshot.tensors)))[1] for _ in range(3)]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--r", type=int, default=16, help="adapter rank")
    parser.add_argument(
        "--targets",
        default="q_proj,k_proj,v_proj,o_proj",
        help="comma-separated target modules (default: model.lora's, the attention projections)",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--vllm", action="store_true", help="also time loading each version into vLLM")
    args = parser.parse_args()
    lora = LoraConfig(r=args.r, alpha=2.0 * args.r, target_modules=args.targets.split(","))

    base = load_model(args.model)
    full, full_snapshot_s = timed(lambda: snapshot_of(base, version=1, step=1))
    adapted = attach_adapters(load_model(args.model), lora, args.model)
    with torch.no_grad():  # a trained adapter: B is no longer zero (the bytes are the same either way)
        for name, param in adapted.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.01)
    adapter, lora_snapshot_s = timed(lambda: lora_snapshot(adapted, version=1))
    rows = []
    for what, snapshot, seconds, with_lora in (
        ("full weights", full, full_snapshot_s, None),
        (f"LoRA r={args.r} ({args.targets})", adapter, lora_snapshot_s, lora),
    ):
        pull_s, data_bytes = asyncio.run(pull_seconds(snapshot, args.repeats))
        load_s = vllm_load_seconds(args.model, snapshot, with_lora) if args.vllm else None
        rows.append(Row(what, data_bytes, len(snapshot.tensors), seconds, pull_s, load_s))
    print(f"model {args.model}")
    print(f"{'version as':44} {'tensors':>7} {'on the wire':>14} {'snapshot':>9} {'gRPC pull':>10} {'vLLM load':>10}")
    for row in rows:
        load = f"{row.load_s * 1e3:8.1f}ms" if row.load_s is not None else f"{'-':>10}"
        print(
            f"{row.what:44} {row.tensors:7d} {row.wire_bytes / 1e6:11.2f} MB {row.snapshot_s * 1e3:7.1f}ms "
            f"{row.pull_s * 1e3:8.1f}ms {load}"
        )
    full_row, lora_row = rows
    print(f"bytes: {full_row.wire_bytes / lora_row.wire_bytes:.1f}x fewer with LoRA")
    print(f"pull:  {full_row.pull_s / lora_row.pull_s:.1f}x faster with LoRA")


if __name__ == "__main__":
    main()
