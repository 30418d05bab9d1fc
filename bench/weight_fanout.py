"""Weight-sync fan-out: trainer-side bytes per version and per-replica time at 1, 2 and 4 replicas.

A "trainer" process serves the real WeightSync service; each replica is its own
process running the rollout's real weight path (PolicyFollower, its Relay on its own
gRPC port, a streaming load into an engine that copies tensors into its weights). For
every round the trainer publishes a new version and each replica syncs as soon as it
hears of it, as an idle rollout does. Schemes, alternated round by round so load from
the rest of the machine hits them alike:

- direct: every replica pulls from the trainer (``relay_fanout: 0``, and the only
  scheme before relaying); the baseline, measured in the same run.
- tree:   the trainer serves at most ``--fanout`` replicas (default 2), each relaying
  replica as many more.
- chain:  fanout 1, the trainer serves one replica.

Printed per replica count and scheme: bytes the trainer sent per version (and as a
multiple of the model on the wire), and seconds from publish to loaded (median over
rounds of the slowest replica, and of the mean replica).

    python -m bench.weight_fanout                        # synthetic 8 x 1024^2 MLP, 33.6 MB
    python -m bench.weight_fanout --layers 16 --rounds 5 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import queue
import statistics
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from bench.weight_sync import synthetic_model
from services.common.pb import weights_pb2_grpc
from services.common.transport.weightsync.client import WeightSyncClient
from services.common.transport.weightsync.relay import Relay, add_relay_to_server
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import Snapshot, snapshot_of
from services.common.transport.weightsync.wire import dtype_named, wire_dtype
from services.rollout.follower import PolicyFollower

SCHEMES = {"direct": 0, "tree": 2, "chain": 1}


def trainer(hidden: int, layers: int, commands: multiprocessing.Queue, replies: multiprocessing.Queue) -> None:
    """Serves WeightSync and obeys the bench: ("fanout", k), ("publish", version), ("members",), ("sent",)."""
    torch.manual_seed(0)
    base = snapshot_of(synthetic_model(hidden, layers), version=1, step=1)

    async def main() -> None:
        weights = WeightSyncServer(base, fanout=0)
        server = grpc.aio.server()
        weights_pb2_grpc.add_WeightSyncServicer_to_server(weights, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        replies.put(port)
        while True:
            command, *args = await asyncio.to_thread(commands.get)
            if command == "fanout":
                weights.fanout = args[0]
                replies.put(None)
            elif command == "publish":
                # A new snapshot object, as the trainer makes each step: its CRCs and casts start empty.
                replies.put(time.monotonic())
                await weights.publish(Snapshot(args[0], args[0], base.tensors))
            elif command == "members":
                replies.put(len(weights.members))
            elif command == "sent":
                replies.put(weights.sent_bytes)

    asyncio.run(main())


class CopyEngine:
    """Copies each tensor into its weights as it arrives (in place after the first load), as an engine does."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            held = self.weights.get(name)
            if held is None:
                self.weights[name] = tensor.clone()
            else:
                held.copy_(tensor)


def replica(trainer_address: str, dtype_name: str, reports: multiprocessing.Queue) -> None:
    """A rollout's weight path; reports (version, monotonic time loaded, origin, bytes relayed) per version."""

    async def main() -> None:
        relay = Relay()
        server = grpc.aio.server()
        add_relay_to_server(relay, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        follower = PolicyFollower(
            CopyEngine(),
            ThreadPoolExecutor(max_workers=1),
            WeightSyncClient(trainer_address),
            dtype=dtype_named(dtype_name) if dtype_name else None,
            relay=relay,
            relay_address=address,
        )
        watcher = asyncio.create_task(follower.watch())
        while True:
            while follower.newest == follower.loaded:
                await asyncio.sleep(0.002)
            await follower.sync()
            if not follower.torn and follower.loaded:
                reports.put((follower.loaded, time.monotonic(), follower.last_origin, relay.sent_bytes))
        watcher.cancel()

    asyncio.run(main())


def run(replicas: int, args: argparse.Namespace, wire_bytes: int) -> dict[str, list[tuple[int, float, float]]]:
    """(trainer bytes, slowest replica s, mean replica s) per measured round, per scheme."""
    context = multiprocessing.get_context("spawn")  # gRPC does not survive fork
    commands, replies, reports = context.Queue(), context.Queue(), context.Queue()
    processes = [context.Process(target=trainer, args=(args.hidden, args.layers, commands, replies), daemon=True)]
    processes[0].start()
    try:
        address = f"127.0.0.1:{replies.get(timeout=300)}"

        def ask(*command: object) -> object:
            commands.put(command)
            return replies.get(timeout=300)

        for _ in range(replicas):
            processes.append(context.Process(target=replica, args=(address, args.dtype, reports), daemon=True))
            processes[-1].start()
            # One at a time, so the tree is in start order (it is in join order).
            while ask("members") != len(processes) - 1:
                time.sleep(0.05)
        results: dict[str, list[tuple[int, float, float]]] = {scheme: [] for scheme in args.schemes}
        version = 1
        for round_ in range(args.rounds + 1):  # round 0 warms channels, windows and the engines' weights
            for scheme in args.schemes:
                ask("fanout", args.fanout if scheme == "tree" else SCHEMES[scheme])
                version += 1
                sent = ask("sent")
                published = ask("publish", version)
                assert isinstance(published, float) and isinstance(sent, int)
                times = []
                while len(times) < replicas:
                    try:
                        loaded, at, _, _ = reports.get(timeout=300)
                    except queue.Empty:
                        raise RuntimeError(f"{scheme}: a replica never loaded version {version}") from None
                    if loaded == version:
                        times.append(at - published)
                trainer_bytes = ask("sent") - sent  # type: ignore[operator]
                if round_:
                    results[scheme].append((trainer_bytes, max(times), statistics.mean(times)))
        return results
    finally:
        for process in processes:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="", help="wire dtype of floating tensors (bfloat16); default: as stored")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--schemes", nargs="+", choices=list(SCHEMES), default=list(SCHEMES))
    parser.add_argument("--fanout", type=int, default=2, help="the tree scheme's fanout")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = synthetic_model(args.hidden, args.layers)
    dtype = dtype_named(args.dtype) if args.dtype else None
    wire_bytes = sum(t.numel() * wire_dtype(t.dtype, dtype).itemsize for t in model.state_dict().values())
    print(f"model on the wire {wire_bytes / 1e6:.1f} MB ({args.dtype or 'as stored'}), {args.rounds} rounds")
    print("replicas  scheme         trainer MB/version  x model   slowest replica s  mean replica s")
    for replicas in args.replicas:
        results = run(replicas, args, wire_bytes)
        for scheme, rounds in results.items():
            sent = statistics.median(r[0] for r in rounds)
            slowest = statistics.median(r[1] for r in rounds)
            mean = statistics.median(r[2] for r in rounds)
            name = f"tree k={args.fanout}" if scheme == "tree" else scheme
            print(
                f"{replicas:8d}  {name:13s}  {sent / 1e6:18.1f}  {sent / wire_bytes:7.2f}"
                f"  {slowest:17.3f}  {mean:14.3f}"
            )


if __name__ == "__main__":
    main()
