"""``rlpipe dead-letters``: list a run's DEAD stream and re-inject messages into the stream they came from.

A re-inject gives the letter's group a second chance and leaves the letter where it is. It writes three things, in
this order: a re-inject record to DEAD (header ``Rlpipe-Reinjected``: the letter's sequence), which the trainer reads
in order with the dead letters and which reopens the group it had settled as dead; the message back on its origin
stream; and a note in DEAD that the copy went (``Rlpipe-Reinject-Sent``), which names no group and which the trainer
passes over. The trainer applies the copy once, like any group in flight, and writes the reopen into the run's
lineage. Deleting the letter instead would leave DEAD without the record a restarted trainer needs to accept the copy.

The record and the copy carry a ``Nats-Msg-Id`` each, and a re-inject looks in DEAD for what an earlier attempt of
it wrote before writing anything, so running the command again after it failed half-way completes it: a record
already there is not written twice, and a copy the broker took although its answer was lost is reported as sent
already (the duplicate window drops the repeat). A re-inject whose note is there is done: running it again sends
nothing and says so, also after the duplicate window, where the broker would have taken a second copy that the
trainer then refuses.

Who wrote a DEAD message is known from its subject (each role publishes only to its own ``dead.<role>``), never from
its headers: the listing names that role, a re-inject sends the copy to the stream that role reads and refuses a
letter whose headers name another (or that sits on another role's subject, ``dead_letters.forged``), and only
records and notes on the operator's subject count. A record's ``Nats-Msg-Id`` another identity took first (a stage
may publish to DEAD under any id) would have the broker drop the operator's record as a repeat: that is caught by
looking at the subject of the message stored under it, and the re-inject fails instead of sending an unrecorded copy.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import msgpack
import nats
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from services.common.config import NatsConfig
from services.common.transport.claim_lifecycle import REINJECT_ID_PREFIX
from services.common.transport.dead_letters import forged
from services.common.transport.nats_connect import connect_options
from services.common.transport.streams import (
    ANY_SUBJECT,
    DEAD,
    EDGES,
    H_CLAIM,
    H_GROUP,
    H_INCARNATION,
    H_REASON,
    H_REINJECT_SENT,
    H_REINJECTED,
    H_SEQ,
    H_SERVICE,
    H_STREAM,
    OPERATOR,
    READS,
    dead_role,
    dead_subject,
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
    reinject_sent: bool = False  # its copy went back too (a re-inject stopped after its record has not)
    forged: str = ""  # why its subject does not vouch for it (dead_letters.forged); "" when it does


async def _dead_messages(js: JetStreamContext, run_id: str, start: int) -> AsyncIterator[Any]:
    """DEAD's messages from sequence ``start`` on, in order, whichever subject each came on."""
    sequence = start
    while True:
        try:
            raw = await js.get_msg(stream_name(run_id, DEAD), seq=sequence, subject=ANY_SUBJECT, next=True)
        except NotFoundError:
            return
        if raw.seq is None:
            raise RuntimeError(f"the broker answered a read of {stream_name(run_id, DEAD)} without a sequence")
        sequence = raw.seq + 1
        yield raw


async def list_dead_letters(
    nats_url: str, run_id: str, limit: int = 1000, options: dict[str, Any] | None = None
) -> list[DeadLetter]:
    nc = await nats.connect(nats_url, **ONE_TRY, **(options or {}))
    try:
        letters: list[DeadLetter] = []
        by_sequence: dict[int, DeadLetter] = {}
        async for raw in _dead_messages(nc.jetstream(), run_id, 1):
            if len(letters) >= limit:
                break
            headers = raw.headers or {}
            why = forged(run_id, raw.subject or "", headers)
            if H_REINJECTED in headers and not why:  # not a letter: the record that an earlier one was sent back
                if (letter := by_sequence.get(_int(headers[H_REINJECTED]))) is not None:
                    letter.reinjected_at = raw.seq
                continue
            if H_REINJECT_SENT in headers and not why:  # nor the note that the copy went
                if (letter := by_sequence.get(_int(headers[H_REINJECT_SENT]))) is not None:
                    letter.reinject_sent = True
                continue
            # The role from the subject; a letter on the bare subject (an older build's) says it in a header.
            role = dead_role(run_id, raw.subject or "")
            letters.append(
                DeadLetter(
                    sequence=raw.seq,
                    origin_stream=headers.get(H_STREAM, "?"),
                    origin_sequence=_int(headers.get(H_SEQ, "0")),
                    service=role if role is not None else headers.get(H_SERVICE, "?"),
                    group_id=headers.get(H_GROUP, ""),
                    reason=headers.get(H_REASON, ""),
                    size=len(raw.data or b""),
                    forged=why or "",
                )
            )
            by_sequence[raw.seq] = letters[-1]
        return letters
    finally:
        await nc.close()


class Outcome(StrEnum):
    SENT = "sent"  # record and copy written now
    COMPLETED = "completed"  # an earlier attempt wrote the record; the copy went now
    ALREADY = "already"  # an earlier attempt sent the copy: nothing was sent again


@dataclass(frozen=True)
class Reinjected:
    """What one re-inject of a letter did."""

    letter: int
    origin: str  # the stream the copy goes to
    record: int  # the DEAD sequence of the re-inject's record
    outcome: Outcome

    def describe(self) -> str:
        if self.outcome == Outcome.SENT:
            return f"re-injected dead letter {self.letter} into {self.origin} (its record: DEAD {self.record})"
        if self.outcome == Outcome.COMPLETED:
            return (
                f"completed the re-inject of dead letter {self.letter} into {self.origin}: an earlier attempt "
                f"stored its record (DEAD {self.record}) but not the copy, which went now"
            )
        return (
            f"dead letter {self.letter} was re-injected into {self.origin} already (its record: DEAD {self.record}); "
            "nothing was sent again"
        )


class ReinjectIncomplete(RuntimeError):
    """A re-inject stopped after its record: running the same command again completes it."""


class ReinjectRefused(ValueError):
    """A DEAD message that must not be sent back (no letter, a forged one), or a record whose id another took."""


def _int(text: str) -> int:
    """A sequence header's number; -1 (no message has it) for one that is none (a forged header may be anything)."""
    return int(text) if text.isdigit() else -1


async def _earlier_attempt(js: JetStreamContext, run_id: str, letter: int) -> tuple[int | None, bool]:
    """What earlier re-injects of DEAD message ``letter`` left after it: its record's sequence (None: no record) and
    whether a note says the copy went."""
    record, sent = None, False
    async for raw in _dead_messages(js, run_id, letter + 1):
        headers = raw.headers or {}
        if forged(run_id, raw.subject or "", headers):  # another identity's record or note: not the operator's
            continue
        if headers.get(H_REINJECTED) == str(letter):
            record = raw.seq
        elif headers.get(H_REINJECT_SENT) == str(letter):
            sent = True
    return record, sent


async def reinject(
    nats_url: str, run_id: str, sequence: int, payload: bytes | None = None, options: dict[str, Any] | None = None
) -> Reinjected:
    """Re-inject DEAD message ``sequence`` (or a fixed ``payload`` in its place) as the module docstring says: the
    record in DEAD, the copy on its origin stream, the note in DEAD, each written unless an earlier attempt did.

    Raises ReinjectRefused for a message that is no dead letter or one its subject does not vouch for, and when
    another identity took the record's id; ReinjectIncomplete when the record is stored but the copy or the note
    could not be written.
    """
    nc = await nats.connect(nats_url, **ONE_TRY, **(options or {}))
    try:
        js = nc.jetstream()
        raw = await js.get_msg(stream_name(run_id, DEAD), seq=sequence)
        letter = raw.headers or {}
        if H_REINJECTED in letter or H_REINJECT_SENT in letter:
            raise ReinjectRefused(f"DEAD message {sequence} records a re-inject; it is no dead letter to send back")
        origin, edge = _origin(run_id, sequence, raw.subject or "", letter)
        record, sent = await _earlier_attempt(js, run_id, sequence)
        if record is not None and sent:
            return Reinjected(sequence, origin, record, Outcome.ALREADY)
        headers = {"Nats-Msg-Id": f"{REINJECT_ID_PREFIX}{sequence}"}
        for carried in (H_GROUP, H_INCARNATION) if payload is not None else (H_GROUP, H_INCARNATION, H_CLAIM):
            if carried in letter:
                headers[carried] = letter[carried]
        if payload is not None:  # a fixed body names its group itself (an undecodable letter may name none)
            headers.update(_group_headers(payload))
        earlier = record is not None
        if record is None:
            record_headers = {key: headers[key] for key in (H_GROUP, H_INCARNATION) if key in headers}
            # Where the letter's message came from, too: the trainer ignores any later letter for that same message
            # (a replay of EXPERIENCE after a resume dead-letters it again), which would settle the reopened group.
            record_headers |= {H_REINJECTED: str(sequence), H_STREAM: origin, H_SEQ: letter.get(H_SEQ, "")}
            record_headers["Nats-Msg-Id"] = f"{REINJECT_ID_PREFIX}{sequence}.record"
            ack = await js.publish(dead_subject(run_id, OPERATOR), b"", headers=record_headers)
            if ack.duplicate:
                await _check_record_ours(js, run_id, sequence, ack.seq)
            record = ack.seq
        body = payload if payload is not None else raw.data or b""
        try:
            copy = await js.publish(subject(run_id, edge), body, headers=headers)
        except Exception as error:  # the broker's many failure types: the record stands, the copy is not sent
            raise ReinjectIncomplete(
                f"dead letter {sequence}: its re-inject record is stored (DEAD {record}) but the copy could not be "
                f"sent to {origin} ({error!r}). Run the same command again to send it: until then the trainer holds "
                "the group reopened, and writes it off as lost after train.lost_after_s"
            ) from error
        if copy.duplicate:
            await _check_copy_ours(js, origin, sequence, copy.seq, body)
        try:  # no Nats-Msg-Id: a second note says the same as the first
            await js.publish(dead_subject(run_id, OPERATOR), b"", headers={H_REINJECT_SENT: str(sequence)})
        except Exception as error:  # the copy went; only the note of it is missing
            raise ReinjectIncomplete(
                f"dead letter {sequence}: its copy is on {origin}, but the note of that could not be stored in DEAD "
                f"({error!r}). Run the same command again to store it"
            ) from error
        if copy.duplicate:  # an earlier attempt's copy landed, its answer did not
            return Reinjected(sequence, origin, record, Outcome.ALREADY)
        return Reinjected(sequence, origin, record, Outcome.COMPLETED if earlier else Outcome.SENT)
    finally:
        await nc.close()


def _origin(run_id: str, sequence: int, on: str, letter: dict[str, str]) -> tuple[str, str]:
    """The stream (and edge) dead letter ``sequence``, published on subject ``on``, goes back to: the one its writer's
    role reads (its subject says the role), or on the bare subject of an older build, the one its header names."""
    if (why := forged(run_id, on, letter)) is not None:
        raise ReinjectRefused(f"dead letter {sequence} is not sent back: {why}")
    role = dead_role(run_id, on)
    if role is not None:
        return stream_name(run_id, READS[role]), READS[role]
    by_stream = {stream_name(run_id, edge): edge for edge in EDGES if edge != DEAD}
    origin = letter.get(H_STREAM, "")
    if origin not in by_stream:
        raise ReinjectRefused(f"dead letter {sequence} names no stream of run {run_id!r} (origin {origin!r})")
    return origin, by_stream[origin]


async def _check_copy_ours(js: JetStreamContext, origin: str, letter: int, stored: int, body: bytes) -> None:
    """The broker took the copy of ``letter`` for a repeat of ``origin``'s message ``stored``: an earlier attempt's
    copy holds the same body; another body means another identity published under the copy's id first, and the
    operator's copy was dropped. One already consumed (work queues keep a message until its stage settles it)
    cannot be told apart: taken for the earlier attempt's."""
    try:
        held = (await js.get_msg(origin, seq=stored)).data or b""
    except NotFoundError:
        return
    if held != body:
        raise ReinjectRefused(
            f"dead letter {letter}: its copy was dropped as a repeat of {origin} message {stored}, which holds another "
            "body that another identity published under the copy's id; nothing was sent. The record stands: the "
            "trainer holds the group reopened and writes it off as lost after train.lost_after_s. Find out which key "
            "wrote it"
        )


async def _check_record_ours(js: JetStreamContext, run_id: str, letter: int, stored: int) -> None:
    """The broker took a re-inject record of ``letter`` for a repeat of DEAD message ``stored``: unless that is on the
    operator's subject, another identity published under the record's id first, and the operator's was dropped."""
    on = (await js.get_msg(stream_name(run_id, DEAD), seq=stored)).subject
    if on != dead_subject(run_id, OPERATOR):
        raise ReinjectRefused(
            f"dead letter {letter}: its re-inject record was dropped as a repeat of DEAD {stored}, which another "
            f"identity published on {on} under the record's id; nothing was sent. Find out which key wrote it"
        )


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
