"""Weight-sync throughput: a gRPC pull of a model against raw loopback TCP and in-memory torch.save+load.

A "trainer" process holds the snapshot and serves it two ways: the real WeightSync
gRPC service, and a plain TCP socket that writes the same bytes (the wire's limit).
This process pulls both, alternating, into fresh memory, as a rollout receives
them. Both baselines are measured in the same run on the same machine, so the
ratios are what to compare across changes and machines.

    python -m bench.weight_sync                      # synthetic 8 x 1024^2 MLP, 33.6 MB
    python -m bench.weight_sync --model models/tiny-arith
    python -m bench.weight_sync --smollm2-135m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import io
import multiprocessing
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import torch

from services.common.pb import weights_pb2_grpc
from services.common.transport.weightsync.client import PULL_CHUNK_BYTES, WeightSyncClient
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import Snapshot, snapshot_of
from services.common.transport.weightsync.wire import dtype_named, wire_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class ModelSpec:
    hidden: int = 1024
    layers: int = 8
    path: str = ""  # an HF model folder
    smollm2_135m: bool = False  # a random model of SmolLM2-135M's shape


def synthetic_model(hidden: int, layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])


def smollm2_135m() -> PreTrainedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def build_model(spec: ModelSpec) -> torch.nn.Module:
    torch.manual_seed(0)
    if spec.path:
        from services.common.model.modeling import load_model

        return load_model(Path(spec.path))
    if spec.smollm2_135m:
        return smollm2_135m()
    return synthetic_model(spec.hidden, spec.layers)


def wire_payload(snapshot: Snapshot, dtype: torch.dtype | None) -> list[memoryview]:
    """The bytes a pull carries (tied tensors once, floats in the wire dtype), for the raw socket to send."""
    unique = {id(t): t for _, t in snapshot.tensors}.values()
    return [
        # (numpy's stubs give arrays the buffer protocol on Python 3.12 and later only)
        memoryview(t.to(wire_dtype(t.dtype, dtype)).reshape(-1).view(torch.uint8).numpy())  # pyright: ignore[reportArgumentType]
        for t in unique
        if t.numel()
    ]


def torch_roundtrip_seconds(snapshot: Snapshot, repeats: int) -> float:
    state = dict(snapshot.tensors)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        torch.load(buffer)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def serve(spec: ModelSpec, dtype_name: str, repeats: int, ready: multiprocessing.Queue) -> None:
    """The trainer side, in its own process as in a deployment: gRPC and a raw socket, until killed."""
    snapshot = snapshot_of(build_model(spec), version=1, step=1)
    payload = wire_payload(snapshot, dtype_named(dtype_name) if dtype_name else None)
    raw = socket.create_server(("127.0.0.1", 0))

    def send_raw() -> None:
        while True:
            conn, _ = raw.accept()
            with conn:
                for view in payload:
                    conn.sendall(view)

    threading.Thread(target=send_raw, daemon=True).start()

    async def main() -> None:
        server = grpc.aio.server()
        weights_pb2_grpc.add_WeightSyncServicer_to_server(WeightSyncServer(snapshot), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.put(
            {
                "grpc_port": port,
                "raw_port": raw.getsockname()[1],
                "model_bytes": snapshot.total_bytes,
                "wire_bytes": sum(len(v) for v in payload),
                "torch_s": torch_roundtrip_seconds(snapshot, repeats),
            }
        )
        await server.wait_for_termination()

    asyncio.run(main())


def raw_pull_seconds(port: int, nbytes: int) -> float:
    started = time.perf_counter()
    buffer = bytearray(nbytes)  # fresh memory each time, as a pull gets
    view, got = memoryview(buffer), 0
    with socket.create_connection(("127.0.0.1", port)) as conn:
        while got < nbytes:
            got += conn.recv_into(view[got:])
    return time.perf_counter() - started


async def grpc_pull_seconds(client: WeightSyncClient, dtype: torch.dtype | None) -> tuple[float, int]:
    started = time.perf_counter()
    stream = client.stream(dtype=dtype)
    async for _ in stream:
        pass
    return time.perf_counter() - started, stream.data_bytes


async def measure(
    info: dict, dtype: torch.dtype | None, repeats: int, chunk_bytes: int
) -> tuple[float, float, float, int, float]:
    """Median gRPC and raw seconds, the median of the ratios of back-to-back pairs, the bytes pulled, and the
    first pull's seconds (it makes the version's CRCs and casts, and warms the channel)."""
    client = WeightSyncClient(f"127.0.0.1:{info['grpc_port']}", chunk_bytes=chunk_bytes)
    first_s, _ = await grpc_pull_seconds(client, dtype)  # warms the channel and its flow-control windows
    raw_pull_seconds(info["raw_port"], info["wire_bytes"])
    grpc_times, raw_times = [], []
    for _ in range(repeats):  # alternate, so load from other processes hits both alike
        seconds, data_bytes = await grpc_pull_seconds(client, dtype)
        grpc_times.append(seconds)
        raw_times.append(raw_pull_seconds(info["raw_port"], info["wire_bytes"]))
    await client.close()
    # Pairs taken back to back see the same load from the rest of the machine: their ratio is steadier than
    # the ratio of two medians.
    ratio = statistics.median(r / g for r, g in zip(raw_times, grpc_times, strict=True))
    return statistics.median(grpc_times), statistics.median(raw_times), ratio, data_bytes, first_s


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", default="", help="HF model folder; default: a synthetic MLP")
    parser.add_argument("--smollm2-135m", action="store_true", help="a random model of SmolLM2-135M's shape")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="", help="wire dtype of floating tensors (bfloat16); default: as stored")
    parser.add_argument("--chunk-kib", type=int, default=PULL_CHUNK_BYTES >> 10)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    spec = ModelSpec(args.hidden, args.layers, args.model, args.smollm2_135m)

    context = multiprocessing.get_context("spawn")  # gRPC does not survive fork
    ready = context.Queue()
    trainer = context.Process(target=serve, args=(spec, args.dtype, args.repeats, ready), daemon=True)
    trainer.start()
    try:
        info = ready.get(timeout=300)
        dtype = dtype_named(args.dtype) if args.dtype else None
        grpc_s, raw_s, wire_ratio, data_bytes, first_s = asyncio.run(
            measure(info, dtype, args.repeats, args.chunk_kib << 10)
        )
    finally:
        trainer.kill()
    assert data_bytes == info["wire_bytes"], (data_bytes, info["wire_bytes"])
    model_mb, wire_mb = info["model_bytes"] / 1e6, info["wire_bytes"] / 1e6
    torch_s = info["torch_s"]
    print(f"model (state dict)    {model_mb:10.1f} MB   on the wire {wire_mb:.1f} MB ({args.dtype or 'as stored'})")
    print(f"gRPC pull             {wire_mb / grpc_s:10.1f} MB/s  ({grpc_s * 1e3:.1f} ms, {args.chunk_kib} KiB chunks)")
    print(f"first pull of version {wire_mb / first_s:10.1f} MB/s  ({first_s * 1e3:.1f} ms, makes CRCs and casts)")
    print(f"raw loopback TCP      {wire_mb / raw_s:10.1f} MB/s  ({raw_s * 1e3:.1f} ms)  baseline: the wire")
    print(f"torch.save+load (RAM) {model_mb / torch_s:10.1f} MB/s  ({torch_s * 1e3:.1f} ms)  baseline: in memory")
    print(f"ratio gRPC/wire       {wire_ratio:10.2f}x  (median over back-to-back pairs)")
    print(f"ratio gRPC/save+load  {torch_s / grpc_s:10.2f}x  (time to move the model, same bytes or fewer)")


if __name__ == "__main__":
    main()
