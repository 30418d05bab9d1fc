"""The host memory policy versions are copied into (``HostStaging``): reused as a double buffer, never refilled while
a version in it is served or pulled, so no pull is torn; and the server's versions only grow.

The server's ``PullWeights`` is driven in-process, a chunk at a time, so that a pull can be held mid-stream while
newer versions are published (over a socket gRPC's buffers decide how far the server has read)."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch

from services.common.pb import weights_pb2 as pb
from services.common.transport.weightsync.server import StaleVersion, WeightSyncServer
from services.common.transport.weightsync.snapshot import HostStaging, NonFiniteWeights
from services.common.transport.weightsync.wire import MIN_CHUNK_BYTES, assemble

pytestmark = pytest.mark.unit


class Model(torch.nn.Module):
    """Two chunks' worth of weights and a tied pair, as an LM's embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 256)
        self.head = torch.nn.Linear(256, 256, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(256)


def moved(model: Model, by: float) -> dict[str, torch.Tensor]:
    """Move every weight by ``by`` (as an optimizer step would, in place); returns a copy of the weights after it."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)
    return {name: t.clone() for name, t in model.state_dict().items()}


def pull_request() -> pb.PullWeightsRequest:
    return pb.PullWeightsRequest(chunk_bytes=MIN_CHUNK_BYTES, accept_aliases=True)


def test_versions_alternate_between_two_host_buffers_and_each_holds_its_own_steps_weights():
    model, staging = Model(), HostStaging()
    server = WeightSyncServer(staging.copy(model.state_dict().items(), 0, 0))

    async def scenario() -> list[int]:
        buffers = [id(server.latest.buffer)]
        for version in (1, 2, 3, 4):
            made = moved(model, 1.0)
            await server.publish(staging.copy(model.state_dict().items(), version, version))
            buffers.append(id(server.latest.buffer))
            served = dict(server.latest.tensors)
            assert all(torch.equal(served[name], tensor) for name, tensor in made.items())
        return buffers

    buffers = asyncio.run(scenario())
    assert len(set(buffers)) == 2 and buffers[0::2] == [buffers[0]] * 3  # a double buffer, no copy allocated
    served = dict(server.latest.tensors)
    assert served["embed.weight"] is served["head.weight"]  # tied: one copy under both names


def test_a_pull_under_way_streams_its_version_whole_while_newer_ones_are_published():
    """Version 1 is pulled a chunk at a time; versions 2 and 3 are published meanwhile. With two buffers only,
    version 3 would be copied over version 1's: the pull's hold keeps that buffer, and version 3 gets another."""
    model, staging = Model(), HostStaging()
    server = WeightSyncServer(staging.copy(model.state_dict().items(), 0, 0))

    async def scenario() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        first = moved(model, 1.0)
        await server.publish(staging.copy(model.state_dict().items(), 1, 1))
        pull = server.PullWeights(pull_request(), None)
        chunks = [await anext(pull)]  # the pull is under way...
        for version in (2, 3):  # ...while the trainer steps and publishes twice
            moved(model, 1.0)
            await server.publish(staging.copy(model.state_dict().items(), version, version))
        buffers = len(staging.buffers)
        chunks += [chunk async for chunk in pull]
        return first, assemble(chunks)[1], buffers

    first, pulled, buffers = asyncio.run(scenario())
    assert set(pulled) == set(first)
    for name, tensor in first.items():
        assert torch.equal(pulled[name], tensor), name  # version 1 whole, though its step's weights moved twice
    assert buffers == 3  # version 3 went to a third buffer while version 1's was pulled
    # Its pull ended: the buffer is idle again, and one idle buffer is all that is kept beside the one served.
    assert len(staging.buffers) == 2 and [b.holds for b in staging.buffers].count(0) == 1


def test_a_refused_version_frees_its_buffer_and_the_served_one_stays():
    model, staging = Model(), HostStaging()
    server = WeightSyncServer(staging.copy(model.state_dict().items(), 0, 0))
    served = server.latest

    async def scenario() -> None:
        with torch.no_grad():
            model.norm.weight.fill_(math.nan)
        with pytest.raises(NonFiniteWeights, match=r"policy version 1 \(step 1\) is not served"):
            await server.publish(staging.copy(model.state_dict().items(), 1, 1))
        with torch.no_grad():
            model.norm.weight.fill_(1.0)
        with pytest.raises(StaleVersion, match="policy version 0 is not above version 0"):
            await server.publish(staging.copy(model.state_dict().items(), 0, 1))

    asyncio.run(scenario())
    assert server.latest is served and served.buffer.holds == 1
    assert len(staging.buffers) == 2 and sorted(b.holds for b in staging.buffers) == [0, 1]


def test_snapshots_handed_out_and_not_published_keep_their_memory():
    """A caller that keeps snapshots (a test comparing versions, a relay's parent) holds each one's buffer: later
    copies never land in it."""
    model, staging = Model(), HostStaging()
    kept = []
    for version in (1, 2, 3):
        made = moved(model, 1.0)
        kept.append((staging.copy(model.state_dict().items(), version, version), made))
    for snapshot, made in kept:
        tensors = dict(snapshot.tensors)
        assert all(torch.equal(tensors[name], tensor) for name, tensor in made.items())
    assert len({id(snapshot.buffer) for snapshot, _ in kept}) == 3


def test_the_first_version_is_served_only_once_its_copy_from_the_gpu_has_landed():
    """On a GPU a snapshot's host tensors fill asynchronously (``copied`` is the copy's CUDA event); version 0 is
    served from the server's first pull on, so the server waits for it, as ``publish`` does for later versions."""

    class CopyEvent:  # a CUDA event's one method the snapshot uses; this machine has no GPU to record one
        synchronized = False

        def synchronize(self) -> None:
            self.synchronized = True

    event = CopyEvent()
    initial = dataclasses.replace(HostStaging().copy(Model().state_dict().items(), 0, 0), copied=event)

    WeightSyncServer(initial)

    assert event.synchronized
