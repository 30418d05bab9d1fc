"""``rlpipe dead-letters``: list a run's DEAD stream and re-inject messages into the stream they came from.

A re-inject gives the letter's group a second chance and leaves the letter where it is: it first appends a
re-inject record to DEAD (header ``Rlpipe-Reinjected``: the letter's sequence), which the trainer reads in
order with the dead letters and which reopens the group it had settled as dead, and then sends the message
back to its origin stream. The trainer applies the copy once, like any group in flight, and writes the reopen
into the run's lineage. Deleting the letter instead would leave DEAD without the record a restarted trainer
needs to accept the copy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import nats
from nats.js.errors import NotFoundError

from services.common.config import NatsConfig
from services.common.transport.claim_lifecycle import REINJECT_ID_PREFIX
from services.common.transport.nats_connect import connect_options
from services.common.transport.streams import (
    DEAD,
    EDGES,
    H_CLAIM,
    H_GROUP,
    H_INCARNATION,
    H_REASON,
    H_REINJECTED,
    H_SEQ,
    H_SERVICE,
    H_STREAM,
    stream_name,
    subject,
)


@dataclass
class DeadLetter:
    sequence: int
    origin_stream: str
    origin_sequence: int
    service: str
    group_id: str
    reason: str
    size: int
    reinjected_at: int | None = None  # the DEAD sequence of the record of its re-inject; None: never re-injected


async def list_dead_letters(
    nats_url: str, run_id: str, limit: int = 1000, options: dict[str, Any] | None = None
) -> list[DeadLetter]:
    nc = await nats.connect(nats_url, **ONE_TRY, **(options or {}))
    try:
        js = nc.jetstream()
        letters: list[DeadLetter] = []
        by_sequence: dict[int, DeadLetter] = {}
        sequence = 1
        while len(letters) < limit:
            try:
                raw = await js.get_msg(
                    stream_name(run_id, "dead"), seq=sequence, subject=subject(run_id, "dead"), next=True
                )
            except NotFoundError:
                break
            headers = raw.headers or {}
            sequence = raw.seq + 1
            if H_REINJECTED in headers:  # not a letter: the record that an earlier one was sent back
                if (letter := by_sequence.get(int(headers[H_REINJECTED]))) is not None:
                    letter.reinjected_at = raw.seq
                continue
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
            by_sequence[raw.seq] = letters[-1]
        return letters
    finally:
        await nc.close()


async def reinject(
    nats_url: str, run_id: str, sequence: int, payload: bytes | None = None, options: dict[str, Any] | None = None
) -> str:
    """Record the re-inject of DEAD message ``sequence`` in DEAD, then publish it (or a fixed ``payload``) back to
    its origin stream. The record goes first: a trainer reading the copy has read the reopen before it.

    Returns the origin stream's name. Re-injecting the same letter again inside the duplicate window is a no-op;
    after it, the trainer refuses the second copy unless the first was dead-lettered again.
    """
    by_stream = {stream_name(run_id, edge): edge for edge in EDGES}
    nc = await nats.connect(nats_url, **ONE_TRY, **(options or {}))
    try:
        js = nc.jetstream()
        raw = await js.get_msg(stream_name(run_id, DEAD), seq=sequence)
        letter = raw.headers or {}
        if H_REINJECTED in letter:
            raise ValueError(f"DEAD message {sequence} records a re-inject; it is no dead letter to send back")
        origin = letter.get(H_STREAM, "")
        if origin not in by_stream:
            raise ValueError(f"dead letter {sequence} names no stream of run {run_id!r} (origin {origin!r})")
        headers = {"Nats-Msg-Id": f"{REINJECT_ID_PREFIX}{sequence}"}
        for carried in (H_GROUP, H_INCARNATION) if payload is not None else (H_GROUP, H_INCARNATION, H_CLAIM):
            if carried in letter:
                headers[carried] = letter[carried]
        if payload is not None:  # a fixed body names its group itself (an undecodable letter may name none)
            headers.update(_group_headers(payload))
        record = {key: headers[key] for key in (H_GROUP, H_INCARNATION) if key in headers}
        # Where the letter's message came from, too: the trainer ignores any later letter for that same message
        # (a replay of EXPERIENCE after a resume dead-letters it again), which would settle the reopened group.
        record |= {H_REINJECTED: str(sequence), H_STREAM: origin, H_SEQ: letter.get(H_SEQ, "")}
        record["Nats-Msg-Id"] = f"{REINJECT_ID_PREFIX}{sequence}.record"
        await js.publish(subject(run_id, DEAD), b"", headers=record)
        await js.publish(
            subject(run_id, by_stream[origin]), payload if payload is not None else raw.data, headers=headers
        )
        return origin
    finally:
        await nc.close()


def _group_headers(payload: bytes) -> dict[str, str]:
    """The group id and incarnation headers a fixed message body calls for (none for a body that is no map)."""
    try:
        body = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError):  # not msgpack (ExtraData and FormatError are ValueErrors), or odd keys
        return {}
    if not isinstance(body, dict):
        return {}
    named = {H_GROUP: body.get("group_id"), H_INCARNATION: body.get("incarnation")}
    return {header: value for header, value in named.items() if isinstance(value, str) and value}


async def _quiet(_: Exception) -> None:
    """nats-py prints every failed connection attempt with its traceback; the command says what failed once."""


# An operator's command tries a broker twice, half a second apart: one that does not answer is reported within
# seconds (NoServersError), not retried for two minutes as nats-py's defaults (60 attempts 2 s apart) would.
ONE_TRY: dict[str, Any] = {
    "allow_reconnect": False,
    "max_reconnect_attempts": 1,
    "reconnect_time_wait": 0.5,
    "connect_timeout": 5,
    "error_cb": _quiet,
}


def nats_url_of(run_dir: Path) -> str:
    info = run_dir / "run.json"
    if not info.is_file():
        raise FileNotFoundError(f"{info} does not exist: pass --nats-url, or point at a run started by `rlpipe run`")
    return json.loads(info.read_text())["nats_url"]


def operator_options(run_dir: Path) -> dict[str, Any]:
    """``nats.connect`` keywords of the operator's key that ``rlpipe run`` left in the run directory, if it did."""
    seed = run_dir / "nats-auth" / "operator.nk"
    return connect_options(NatsConfig(nkey_seed_file=seed), "operator") if seed.is_file() else {}
