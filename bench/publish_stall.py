"""What publishing a policy version costs the trainer's event loop and its next step, before and after ``Publisher``.

Before, the step published its version itself: a fresh host copy of the weights (``snapshot_of``) made on the event
loop, then the finite check on a thread, awaited; the step and the loop waited for both. Now ``Publisher.offer``
returns at once; the copy goes into reused host memory (``HostStaging``) on a worker thread, and the check and the
serve follow in the background. The next step waits only if that copy is still being taken when it starts.

On a random model of SmolLM2-135M's shape (float32 master weights, as the trainer holds them) this times, per
version, the median over ``--versions`` versions of:

- the longest the event loop went without running (a task that ticks every millisecond measures its lag);
- what the step waited for: the whole publish before, ``offer`` after;
- after: the copy alone (what the next step waits for at most, when its batch is ready sooner), and the whole
  background offer (``weights/offer_s`` in the step rows).

    python -m bench.publish_stall [--versions 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from bench.weight_sync import smollm2_135m
from services.common.transport.weightsync.server import WeightSyncServer
from services.common.transport.weightsync.snapshot import HostStaging, Snapshot, non_finite, snapshot_of
from services.trainer.publisher import Publisher


class Weights:
    """The learner's side of a publish: its model's state copied into reused host memory, as ``Learner.snapshot``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.staging = HostStaging()
        self.copy_s: list[float] = []

    def snapshot(self, version: int, step: int) -> Snapshot:
        started = time.perf_counter()
        snapshot = self.staging.copy(self.model.state_dict().items(), version, step)
        self.copy_s.append(time.perf_counter() - started)
        return snapshot


async def longest_lag(during: asyncio.Task) -> float:
    """The longest the loop went without running this task's 1 ms ticks while ``during`` ran."""
    longest, last = 0.0, time.perf_counter()
    while not during.done():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest


async def refused(error: Exception, version: int, step: int) -> None:
    raise AssertionError(f"version {version} was refused: {error}")


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} ms"


async def measure(model: torch.nn.Module, versions: int) -> None:
    server = WeightSyncServer(snapshot_of(model, 0, 0))

    async def before(version: int) -> None:
        snapshot = snapshot_of(model, version, version)  # on the loop, as the step did
        await asyncio.to_thread(non_finite, snapshot.tensors)
        await server.publish(snapshot)

    lags, waits = [], []
    for version in range(1, versions + 1):
        started = time.perf_counter()
        task = asyncio.create_task(before(version))
        lags.append(await longest_lag(task))
        await task
        waits.append(time.perf_counter() - started)
    print(f"| before | {ms(lags)} | {ms(waits)} | | |", flush=True)

    weights = Weights(model)
    publisher = Publisher(weights, server, refused)
    lags, waits, offers = [], [], []
    for version in range(versions + 1, 2 * versions + 2):
        started = time.perf_counter()
        publisher.offer(version, version)
        waits.append(time.perf_counter() - started)
        task = asyncio.create_task(publisher.drain())
        lags.append(await longest_lag(task))
        await task
        offers.append(publisher.offer_s or 0.0)
    # The first copy allocates the buffers; later ones reuse them, as a run's do.
    copies, lags, waits, offers = weights.copy_s[1:], lags[1:], waits[1:], offers[1:]
    print(f"| after | {ms(lags)} | {ms(waits)} | {ms(copies)} | {ms(offers)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = smollm2_135m()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: SmolLM2-135M shape, {params / 1e6:.1f} M parameters, float32, cpu", flush=True)
    print("| publish | event loop held (longest) | the step waited | copy (next step waits at most) | background |")
    print("| --- | --- | --- | --- | --- |")
    asyncio.run(measure(model, args.versions))


if __name__ == "__main__":
    main()
