"""Trainer -> rollout weight sync over gRPC (``proto/weights.proto``).

One job a module: ``snapshot`` (what a version is), ``wire`` (chunks, their checks and reassembly, no I/O),
``server`` (the trainer's side and the relay tree's plan), ``client`` (a rollout's pull) and ``relay`` (a rollout
forwarding a version to its children).

The trainer publishes each new policy version as an immutable snapshot of its
state dict; rollouts watch for versions and pull a snapshot as a stream of
CRC-checked chunks. A tensor is handed on as soon as its last chunk arrived, so a
rollout can load it while the rest of the model is still on the wire.

Where the time goes, and what this module does about it (measured with
``python -m bench.weight_sync``):

- Protobuf decoding of a chunk copies its data twice (parse, then the ``data``
  accessor). The client asks gRPC for the raw message bytes instead, lets protobuf
  parse only the small fields (:func:`split_chunk` cuts the data field out) and
  checks and copies the data straight from the received buffer into the tensor.
- The server slices each chunk out of the snapshot's memory, so a pull never holds a
  second whole copy of a tensor; tensors that share storage (tied embeddings) are
  copied once into the snapshot and sent once to clients that accept aliases.
- A client can ask for the rollout's dtype (bf16 halves the bytes of an fp32 trainer). Each tensor is
  cast once per version, on the first pull that needs it, and the cast kept with the snapshot for every
  later puller (the cast cost more than the wire).

Fan-out (``python -m bench.weight_fanout``): the trainer's egress is what N replicas share, so a version
leaves the trainer at most ``fanout`` times whatever N is. Replicas that keep a ``WatchVersions`` stream
open with their ``relay_address`` form a tree, fixed when a version is published (join order, ``fanout``
children per node, the trainer at the root); each announcement tells a replica where to pull from and
whether to keep what it pulls for its children (:class:`Relay`). A relay forwards the raw messages it
received as they arrive, so a version crosses the tree in about one model transfer plus a chunk per
level, not one transfer per level. Any pull from a peer that fails falls back to the trainer.

A peer is trusted with nothing it could forge (every rollout holds the token and the TLS certificate): a pull from a
peer must be the version asked for, and its :class:`wire.StreamDigest` must be the one the trainer gives
(``GetDigest``), or it is not used and the version comes from the trainer; the trainer keeps a relay address in the
tree only if it is on the host its watch came from.
"""
