"""A policy version as an immutable CPU snapshot of the model's tensors, with the casts and checksums its pulls
share, the host memory it lives in, and the check that keeps NaN or infinite weights from being served or saved.

Host memory (``HostStaging``). Versions are copied into host buffers that are reused from version to version: a
fresh allocation per version costs page faults on the CPU and, from a GPU, an unpinned (slow, synchronous) copy,
and pinned memory is itself too slow to allocate per version. Two buffers serve in steady state (the version served
and the one being filled: a double buffer); another is allocated only while a slow pull still streams an older
version, and dropped again once idle. A buffer is refilled only when nothing holds it: ``HostStaging.copy`` hands a
snapshot out holding its buffer once, ``WeightSyncServer.publish`` keeps that hold while the version is served (and
gives it back when the version is replaced or refused), and each pull holds it while it streams. So a pull never
reads a buffer that is being refilled: no version is torn, half one step and half the next.

On CUDA the copies go into pinned memory on a stream of their own, queued after the work already on the device (the
step that made the weights); the device's own stream then waits for them, so the next step's kernels cannot change a
weight before it was copied, and the thread that queued them is free at once. ``Snapshot.wait_copied`` blocks until
the copies have landed in host memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.pb import weights_pb2 as pb


@dataclass(frozen=True)
class Snapshot:
    version: int
    step: int
    tensors: tuple[tuple[str, torch.Tensor], ...]
    # Chunk CRCs per (wire dtype, chunk bytes, aliases), filled by the first pull of this version and reused by
    # every later one: N replicas cost the trainer one checksum pass per version, not N.
    crcs: dict[tuple[str, int, bool], list[int]] = field(default_factory=dict, compare=False, repr=False)
    # The StreamDigest of this version per (wire dtype text, aliases), kept by its first whole pull (or computed for
    # a GetDigest that came first): what a replica that got the version through relays checks its stream against.
    digests: dict[tuple[str, bool], bytes] = field(default_factory=dict, compare=False, repr=False)
    # Tensors cast to a wire dtype (flat), by (id of the stored tensor, dtype): filled chunk by chunk by the first
    # pull that asks for that dtype and shared by every later one, freed with the snapshot when the next version
    # replaces it. `cast_upto` is how many elements of each are filled (every pull walks a tensor in order).
    casts: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    cast_upto: dict[tuple[int, torch.dtype], int] = field(default_factory=dict, compare=False, repr=False)
    # The reused host memory the tensors live in (None: memory of their own) and, on CUDA, the event of their copy.
    buffer: HostBuffer | None = field(default=None, compare=False, repr=False)
    copied: Any = field(default=None, compare=False, repr=False)

    def hold(self) -> None:
        """Keep the tensors' memory from being refilled until ``release``: a pull streaming them, a serving server."""
        if self.buffer is not None:
            self.buffer.hold()

    def release(self) -> None:
        if self.buffer is not None:
            self.buffer.release()

    def wait_copied(self) -> None:
        """Block until the tensors hold the version (its copies from a GPU may still be on their way)."""
        if self.copied is not None:
            self.copied.synchronize()

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def piece(self, tensor: torch.Tensor, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of ``tensor`` (one of this snapshot's, flattened) in ``dtype``, cast once.

        The cast is kept whole but made a chunk at a time, as pulls reach it: casting a whole tensor into
        fresh memory at once measured 2-6x slower than chunk by chunk (page faults, cache misses)."""
        flat = tensor.reshape(-1)
        if tensor.dtype == dtype:
            return flat[start:stop]
        key = (id(tensor), dtype)
        cast = self.casts.get(key)
        if cast is None:
            cast = self.casts[key] = torch.empty(flat.numel(), dtype=dtype)
        done = self.cast_upto.get(key, 0)
        if stop > done:
            cast[done:stop].copy_(flat[done:stop])
            self.cast_upto[key] = stop
        return cast[start:stop]

    def info(self) -> pb.PolicyVersion:
        return pb.PolicyVersion(
            version=self.version, step=self.step, num_tensors=len(self.tensors), total_bytes=self.total_bytes
        )


class NonFiniteWeights(ValueError):
    """Weights holding NaN or infinite values: never served to rollouts, never saved."""


def non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors in ``tensors`` that hold a NaN or an infinite value."""
    return [name for name, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def snapshot_of(model: torch.nn.Module, version: int, step: int) -> Snapshot:
    """A detached CPU copy of ``model``'s parameters and buffers in memory of its own, safe to stream while training
    goes on (``HostStaging.copy`` without a buffer to reuse)."""
    return HostStaging().copy(model.state_dict().items(), version, step)


class HostBuffer:
    """Host tensors one version at a time is copied into, and how many hold it (see the module's docstring)."""

    def __init__(self, staging: HostStaging, layout: tuple[Any, ...], tensors: list[torch.Tensor]):
        self.staging = staging
        self.layout = layout  # what it fits: the names, which of them share a tensor, each tensor's shape and dtype
        self.tensors = tensors
        self.holds = 0  # the snapshot handed out (then the server serving it), and each pull streaming it

    def hold(self) -> None:
        with self.staging.lock:
            self.holds += 1

    def release(self) -> None:
        with self.staging.lock:
            self.holds -= 1
            if self.holds == 0:
                self.staging.idle(self)


class HostStaging:
    """The host buffers versions are copied into: the newest ones idle are refilled, pinned when the source is on a
    GPU. ``copy`` runs on a worker thread; holds are taken and given back on the event loop's (hence the lock)."""

    KEEP_IDLE = 1  # with the one being served, a double buffer

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buffers: list[HostBuffer] = []
        self.streams: dict[torch.device, Any] = {}

    def idle(self, buffer: HostBuffer) -> None:
        """``buffer`` is held by nobody (called under the lock): kept to be refilled, or dropped past KEEP_IDLE."""
        if sum(1 for b in self.buffers if b.holds == 0) > self.KEEP_IDLE and buffer in self.buffers:
            self.buffers.remove(buffer)

    def copy(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, step: int) -> Snapshot:
        """``tensors`` (a state dict's items) as version ``version``, copied into an idle buffer that fits them or a
        new one; the snapshot holds it once.

        Names that share storage (tied embeddings) share one copy: they are listed under every name, because
        vLLM's reload_weights keeps its own lm_head and does not re-tie it, but cost host memory once."""
        names, sources, slots = _unique(tensors)
        layout = (tuple(names), tuple(slots), tuple((tuple(t.shape), t.dtype) for t in sources))
        buffer = self._take(layout, sources)
        copied = None
        devices = {t.device for t in sources if t.is_cuda}
        if devices:
            copied = self._copy_from_gpu(buffer.tensors, sources, devices.pop())
        else:
            for host, source in zip(buffer.tensors, sources, strict=True):
                host.copy_(source)
        tensors_by_name = tuple((name, buffer.tensors[slot]) for name, slot in zip(names, slots, strict=True))
        return Snapshot(version=version, step=step, tensors=tensors_by_name, buffer=buffer, copied=copied)

    def _take(self, layout: tuple[Any, ...], sources: Sequence[torch.Tensor]) -> HostBuffer:
        with self.lock:
            for buffer in self.buffers:
                if buffer.holds == 0 and buffer.layout == layout:
                    buffer.holds = 1
                    return buffer
        pin = any(t.is_cuda for t in sources)
        made = HostBuffer(self, layout, [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in sources])
        made.holds = 1
        with self.lock:
            self.buffers.append(made)
        return made

    def _copy_from_gpu(self, hosts: list[torch.Tensor], sources: list[torch.Tensor], device: torch.device) -> Any:
        """Queue the device-to-host copies after the device's queued work, and the device's later work after them;
        returns the event that marks them done."""
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device)
        compute = torch.cuda.current_stream(device)
        stream.wait_stream(compute)  # the step that made these weights has finished writing them
        with torch.cuda.stream(stream):
            for host, source in zip(hosts, sources, strict=True):
                host.copy_(source, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
        compute.wait_event(copied)  # the next step's updates wait until every weight is copied
        return copied


def _unique(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[torch.Tensor], list[int]]:
    """The names, the distinct tensors among them (a view sharing storage, shape and strides is one), and each
    name's index into those."""
    names: list[str] = []
    sources: list[torch.Tensor] = []
    slots: list[int] = []
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], int] = {}
    for name, t in tensors:
        t = t.detach()
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() == 0 or key not in seen:  # empty tensors all have data_ptr 0
            seen[key] = len(sources)
            sources.append(t)
        names.append(name)
        slots.append(seen[key])
    return names, sources, slots
