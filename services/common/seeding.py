"""The seed each sample is drawn with in a reproducible run (``train.deterministic``).

A group's completions must not depend on which replica generated it, which prompts shared its engine call, or
how many groups came before it on this replica: so no engine draws from a stream shared across samples. Each sample
(each turn of an episode) draws from a generator of its own, seeded by ``sampling_seed``, which depends only on the
run's seed and the sample's place in the run: its group id (``e<epoch>-i<position>``, the feeder's order, the same in
every run of the config), its index in the group and the turn. Every engine applies it alike: vLLM as the per-request
``SamplingParams.seed`` (one request per sample), transformers as one ``torch.Generator`` per sample.
"""

from __future__ import annotations

import hashlib


def sampling_seed(run_seed: int, group_id: str, index: int, turn: int = 0) -> int:
    """The seed of sample ``index`` of group ``group_id``'s draws in turn ``turn`` (0 for a single-turn completion):
    ``blake2b("<run_seed>/<group_id>/<index>/<turn>")``'s first 8 bytes, little-endian, halved to below 2**63.

    A hash, not ``hash()`` (salted per process) nor ``run_seed + index`` (groups would share streams): two samples,
    turns or runs of other seeds draw from unrelated streams. Below 2**63 because engines add small offsets to a
    request's seed and torch takes a signed 64-bit one."""
    key = f"{run_seed}/{group_id}/{index}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
