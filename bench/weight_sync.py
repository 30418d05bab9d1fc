"""Weight-sync throughput: a full gRPC pull of a model, against an in-memory torch.save/load of the same tensors.

Prints MB/s for both and their ratio; the baseline is measured in the same run on the
same machine, so the ratio is what to compare across changes.

    python -m bench.weight_sync [--model models/tiny-arith] [--hidden 1024 --layers 8]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import time

import grpc
import torch

from services.common.pb import weights_pb2_grpc
from services.common.weightsync import WeightSyncClient, WeightSyncServer, snapshot_of


def synthetic_model(hidden: int, layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])


async def grpc_pull_seconds(model: torch.nn.Module, repeats: int) -> float:
    weights = WeightSyncServer(snapshot_of(model, version=1, step=1))
    server = grpc.aio.server()
    weights_pb2_grpc.add_WeightSyncServicer_to_server(weights, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WeightSyncClient(f"127.0.0.1:{port}")
    await client.pull()  # warm the channel
    started = time.perf_counter()
    for _ in range(repeats):
        await client.pull()
    elapsed = (time.perf_counter() - started) / repeats
    await client.close()
    await server.stop(0)
    return elapsed


def torch_roundtrip_seconds(model: torch.nn.Module, repeats: int) -> float:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    started = time.perf_counter()
    for _ in range(repeats):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        torch.load(buffer)
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model folder; default: a synthetic MLP")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.model:
        from services.common.modeling import load_model

        model = load_model(args.model)
    else:
        model = synthetic_model(args.hidden, args.layers)
    megabytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
    grpc_s = asyncio.run(grpc_pull_seconds(model, args.repeats))
    base_s = torch_roundtrip_seconds(model, args.repeats)
    print(f"model size            {megabytes:10.1f} MB")
    print(f"gRPC pull (chunked)   {megabytes / grpc_s:10.1f} MB/s  ({grpc_s * 1e3:.1f} ms)")
    print(f"torch.save+load (RAM) {megabytes / base_s:10.1f} MB/s  ({base_s * 1e3:.1f} ms)  baseline")
    print(f"ratio gRPC/baseline   {base_s / grpc_s:10.2f}x")


if __name__ == "__main__":
    main()
