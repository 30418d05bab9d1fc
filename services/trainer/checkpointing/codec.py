"""How a checkpoint part may be stored compressed (``checkpoint.compression: zlib``), as pure functions.

Floating-point weights barely compress byte by byte: a float32's low mantissa bytes are close to random. Their
exponent bytes are not (weights of one layer share a narrow range of magnitudes), so the bytes are first
*shuffled* into lanes: every element's byte 0, then every byte 1, and so on (``lane`` = the element size), which
puts the exponents side by side. zlib then deflates the lanes with the run-length strategy (level 1): the gain is
in entropy-coding the exponent lanes, and RLE leaves out the string matching that costs deflate most of its time
for no gain on such data. Done ``BLOCK`` bytes at a time, so the shuffled copy never holds a whole part.

The codec a part was stored with is written in its manifest entry (``Codec.name``, e.g. ``zlib/shuffle4/block16M``)
with the part's size before compression, and the stored object's name gets ``SUFFIX``, so nothing takes a
compressed ``model.safetensors.zlib`` for a loadable file.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

SUFFIX = ".zlib"
BLOCK = 16 << 20  # bytes shuffled and fed to zlib at a time: a multiple of every lane width
# The parts worth compressing: the weights and the optimizer's moments; the rest are small.
COMPRESSIBLE = ("model.safetensors", "critic.safetensors", "optimizer.pt")
_NAME = re.compile(r"^zlib/shuffle(\d+)/block(\d+)M$")


class UnknownCodec(ValueError):
    """A manifest names a codec this rlpipe does not read."""


@dataclass(frozen=True)
class Codec:
    """zlib over bytes shuffled into ``lane``-byte lanes, ``block_mib`` MiB at a time."""

    lane: int
    block_mib: int = BLOCK >> 20

    @property
    def name(self) -> str:
        return f"zlib/shuffle{self.lane}/block{self.block_mib}M"

    @classmethod
    def parse(cls, name: str) -> Codec:
        match = _NAME.match(name)
        if match is None or int(match.group(1)) < 1 or int(match.group(2)) < 1:
            raise UnknownCodec(f"checkpoint part codec {name!r} is not one this rlpipe reads ({cls(4).name}, ...)")
        return cls(int(match.group(1)), int(match.group(2)))

    @property
    def block(self) -> int:
        return (self.block_mib << 20) // self.lane * self.lane


def shuffle(data: bytes | memoryview, lane: int) -> bytes:
    """``data``'s bytes by lane: byte 0 of every ``lane``-byte element, then byte 1, ...; a tail shorter than a
    lane stays at the end as it is."""
    whole = len(data) // lane * lane
    array = np.frombuffer(data, dtype=np.uint8)
    return array[:whole].reshape(-1, lane).T.tobytes() + bytes(array[whole:])


def unshuffle(data: bytes | memoryview, lane: int) -> bytes:
    """The inverse of ``shuffle``."""
    whole = len(data) // lane * lane
    array = np.frombuffer(data, dtype=np.uint8)
    return array[:whole].reshape(lane, -1).T.tobytes() + bytes(array[whole:])


def compress(data: bytes, codec: Codec) -> bytes:
    """``data`` shuffled block by block and deflated as one zlib stream."""
    deflate = zlib.compressobj(1, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    view = memoryview(data)
    out = [
        deflate.compress(shuffle(view[at : at + codec.block], codec.lane)) for at in range(0, len(data), codec.block)
    ]
    out.append(deflate.flush())
    return b"".join(out)


def decompress(data: bytes, codec: Codec, size: int) -> bytes:
    """The ``size`` bytes ``compress`` stored as ``data``; ValueError when they do not come back whole."""
    try:
        shuffled = zlib.decompress(data)
    except zlib.error as error:
        raise ValueError(f"does not inflate: {error}") from None
    if len(shuffled) != size:
        raise ValueError(f"inflates to {len(shuffled)} bytes, its manifest says {size}")
    view = memoryview(shuffled)
    return b"".join(unshuffle(view[at : at + codec.block], codec.lane) for at in range(0, size, codec.block))


def lane_of(tensors: Iterable[torch.Tensor]) -> int:
    """The element size holding most of ``tensors``' bytes: the lane their file shuffles best by."""
    by_size: dict[int, int] = {}
    for tensor in tensors:
        by_size[tensor.element_size()] = by_size.get(tensor.element_size(), 0) + tensor.numel() * tensor.element_size()
    return max(by_size, key=by_size.__getitem__, default=1)
