"""``rlpipe dead-letters``: list a run's DEAD stream and re-inject messages into the stream they came from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from nats.js.errors import NotFoundError

from services.common.config import NatsConfig
from services.common.transport.bus import (
    EDGES,
    H_CLAIM,
    H_GROUP,
    H_REASON,
    H_SEQ,
    H_SERVICE,
    H_STREAM,
    stream_name,
    subject,
)
from services.common.transport.nats_connect import connect_options


@dataclass
class DeadLetter:
    sequence: int
    origin_stream: str
    origin_sequence: int
    service: str
    group_id: str
    reason: str
    size: int


async def list_dead_letters(
    nats_url: str, run_id: str, limit: int = 1000, options: dict[str, Any] | None = None
) -> list[DeadLetter]:
    nc = await nats.connect(nats_url, **(options or {}))
    try:
        js = nc.jetstream()
        letters: list[DeadLetter] = []
        sequence = 1
        while len(letters) < limit:
            try:
                raw = await js.get_msg(
                    stream_name(run_id, "dead"), seq=sequence, subject=subject(run_id, "dead"), next=True
                )
            except NotFoundError:
                break
            headers = raw.headers or {}
            letters.append(
                DeadLetter(
                    sequence=raw.seq,
                    origin_stream=headers.get(H_STREAM, "?"),
                    origin_sequence=int(headers.get(H_SEQ, 0)),
                    service=headers.get(H_SERVICE, "?"),
                    group_id=headers.get(H_GROUP, ""),
                    reason=headers.get(H_REASON, ""),
                    size=len(raw.data or b""),
                )
            )
            sequence = raw.seq + 1
        return letters
    finally:
        await nc.close()


async def reinject(
    nats_url: str, run_id: str, sequence: int, payload: bytes | None = None, options: dict[str, Any] | None = None
) -> str:
    """Publish DEAD message ``sequence`` (or a fixed ``payload``) back to its origin stream; then remove it from DEAD.

    Returns the origin stream's name.
    """
    by_stream = {stream_name(run_id, edge): edge for edge in EDGES}
    nc = await nats.connect(nats_url, **(options or {}))
    try:
        js = nc.jetstream()
        raw = await js.get_msg(stream_name(run_id, "dead"), seq=sequence)
        origin = (raw.headers or {}).get(H_STREAM, "")
        if origin not in by_stream:
            raise ValueError(f"dead letter {sequence} names no stream of run {run_id!r} (origin {origin!r})")
        headers = {"Nats-Msg-Id": f"reinjected.{sequence}"}
        for carried in (H_GROUP,) if payload is not None else (H_GROUP, H_CLAIM):
            if raw.headers and carried in raw.headers:
                headers[carried] = raw.headers[carried]
        await js.publish(
            subject(run_id, by_stream[origin]), payload if payload is not None else raw.data, headers=headers
        )
        await js.delete_msg(stream_name(run_id, "dead"), sequence)
        return origin
    finally:
        await nc.close()


def nats_url_of(run_dir: Path) -> str:
    info = run_dir / "run.json"
    if not info.is_file():
        raise FileNotFoundError(f"{info} does not exist: pass --nats-url, or point at a run started by `rlpipe run`")
    return json.loads(info.read_text())["nats_url"]


def operator_options(run_dir: Path) -> dict[str, Any]:
    """``nats.connect`` keywords of the operator's key that ``rlpipe run`` left in the run directory, if it did."""
    seed = run_dir / "nats-auth" / "operator.nk"
    return connect_options(NatsConfig(nkey_seed_file=seed), "operator") if seed.is_file() else {}
