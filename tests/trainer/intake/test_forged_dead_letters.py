"""Dead letters on a broker with the run's per-role keys: a letter counts for what its DEAD subject (its writer's
role) vouches for, whatever its headers say, for the trainer and for `rlpipe dead-letters` alike."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.js import api

from services.cli.dead_letters import ReinjectRefused, list_dead_letters, operator_options, reinject
from services.common.config import RunConfig, load_config
from services.common.model.datasets import load_jsonl
from services.common.transport.bus import Bus
from services.common.transport.claim_lifecycle import REINJECT_ID_PREFIX
from services.common.transport.nats_auth import RoleKey
from services.common.transport.nats_connect import connect_options
from services.common.transport.streams import (
    DEAD,
    EXPERIENCE,
    H_GROUP,
    H_REINJECTED,
    H_SEQ,
    H_SERVICE,
    H_STREAM,
    READS,
    StreamMessage,
    dead_subject,
    stream_name,
    subject,
)
from services.trainer.intake.feeder import PromptFeeder
from services.trainer.intake.ledger import Fate, GroupLedger
from services.trainer.intake.reader import Intake
from services.trainer.progress import Progress
from tests.support.runs import config_file, rlpipe_command
from tests.support.servers import keyed_nats

pytestmark = pytest.mark.integration

RUN = "forge"


@pytest.fixture
def keyed(tiny_model, tmp_path: Path) -> Iterator[tuple[RunConfig, dict[str, RoleKey], list]]:
    """A broker with the run's per-role keys under the run directory (where `rlpipe dead-letters` finds the
    operator's), the run's config and its prompts."""
    run_dir = tmp_path / "runs" / RUN
    run_dir.mkdir(parents=True)
    with keyed_nats(run_dir, RUN) as (url, keys):
        (run_dir / "run.json").write_text(json.dumps({"nats_url": url}))
        cfg = load_config(config_file(tmp_path, tiny_model, run_id=RUN, nats={"url": url}))
        yield cfg, keys, load_jsonl(tiny_model[1] / "train.jsonl")


def fed_ledger(count: int) -> GroupLedger:
    """A ledger that has fed the groups e0-i0 .. e0-i{count-1}."""
    ledger = GroupLedger()
    for i in range(count):
        ledger.fed(f"e0-i{i}", now=0.0)
    return ledger


def intake_of(bus: Bus, rows: list, ledger: GroupLedger, progress: Progress, reopened: list | None = None) -> Intake:
    """The trainer's intake on ``bus``; the groups it reopens are appended to ``reopened``."""

    async def lost(group_ids: list[str]) -> None:
        raise AssertionError(f"nothing may be written off here: {group_ids}")

    async def record(group_id: str, dead_letter: int) -> None:
        if reopened is None:
            raise AssertionError(f"nothing may be reopened here: {group_id}")
        reopened.append((group_id, dead_letter))

    feeder = PromptFeeder(rows, 0, shuffle=False)
    return Intake(bus, feeder, ledger, progress, lost, on_reopened=record, vocab_size=64)


def as_role(cfg: RunConfig, keys: dict[str, RoleKey], role: str) -> RunConfig:
    return cfg.model_copy(update={"nats": cfg.nats.model_copy(update={"nkey_seed_file": keys[role].seed_file})})


async def forge(cfg: RunConfig, keys: dict[str, RoleKey], headers: dict[str, str]) -> int:
    """What a rollout's key can write to DEAD: anything, on its own subject. Returns its sequence."""
    nc = await nats.connect(cfg.nats.url, **connect_options(as_role(cfg, keys, "rollout").nats, "rollout"))
    ack = await nc.jetstream().publish(dead_subject(RUN, "rollout"), b"forged", headers=headers)
    await nc.close()
    return ack.seq


async def genuine_letter(cfg: RunConfig, keys: dict[str, RoleKey], role: str, group_id: str, seq: int) -> None:
    """``role``'s dead letter of message ``seq`` of the stream it reads, written as its stage writes one."""
    bus = await Bus(as_role(cfg, keys, role), role).connect()
    message = StreamMessage(seq, f"body of {group_id}".encode(), {H_GROUP: group_id})
    await bus.dead_letter(message, "invalid message", READS[role])
    await bus.close()


def test_forged_dead_letters_settle_and_reopen_nothing_and_genuine_ones_of_every_role_do(keyed, caplog):
    """A rollout writes a letter naming EXPERIENCE (and claiming to be the reference's), and a re-inject record for
    a dead group, on its own subject: the trainer ignores both, so the first group stays in flight and the second
    dead. Each role's own letter settles its group, and the operator's re-inject of one reopens it."""
    cfg, keys, rows = keyed
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        trainer = await Bus(as_role(cfg, keys, "trainer"), "trainer").connect()
        ledger = fed_ledger(6)
        ledger.settle(["e0-i5"], step=0, fate=Fate.DEAD)  # dead before: a forged record would reopen it
        reopened: list[tuple[str, int]] = []
        intake = intake_of(trainer, rows, ledger, Progress(step=1), reopened)
        await forge(
            cfg, keys, {H_GROUP: "e0-i0", H_STREAM: stream_name(RUN, EXPERIENCE), H_SEQ: "7", H_SERVICE: "reference"}
        )
        await forge(cfg, keys, {H_GROUP: "e0-i5", H_REINJECTED: "1", H_STREAM: stream_name(RUN, EXPERIENCE)})
        assert await intake.catch_up_dead() == 0
        assert "e0-i0" in ledger.in_flight and ledger.fate("e0-i5") == Fate.DEAD and reopened == []
        forged_events = [r for r in caplog.records if r.getMessage() == "dead_letter_forged"]
        assert [r.fields["seq"] for r in forged_events] == [1, 2]

        for n, role in enumerate(("rollout", "reward", "reference", "trainer"), start=1):
            await genuine_letter(cfg, keys, role, f"e0-i{n}", seq=n)
        assert await intake.catch_up_dead() == 4
        assert sorted(ledger.in_flight) == ["e0-i0"]
        assert all(ledger.fate(f"e0-i{n}") == Fate.DEAD for n in range(1, 5))

        operator = operator_options(cfg.run_dir)
        for sequence, role in zip(range(3, 7), ("rollout", "reward", "reference", "trainer"), strict=True):
            sent = await reinject(cfg.nats.url, RUN, sequence, None, operator)
            origin = stream_name(RUN, READS[role])
            assert sent.origin == origin
            copy = await trainer.js.get_last_msg(origin, subject(RUN, READS[role]))
            assert copy.data == f"body of e0-i{sequence - 2}".encode()
        assert await intake.catch_up_dead() == 0
        assert [group for group, _ in reopened] == ["e0-i1", "e0-i2", "e0-i3", "e0-i4"]
        assert sorted(ledger.in_flight) == ["e0-i0", "e0-i1", "e0-i2", "e0-i3", "e0-i4"]
        await trainer.close()

    asyncio.run(scenario())


def test_a_forged_letter_is_listed_under_its_writers_role_and_refused_by_reinject(keyed):
    """A rollout's letter naming EXPERIENCE and claiming the reference wrote it: the listing names the rollout and
    says it is forged, and `--reinject` refuses it in one line (exit 1) and sends nothing into training."""
    cfg, keys, _ = keyed

    async def setup() -> None:
        trainer = await Bus(as_role(cfg, keys, "trainer"), "trainer").connect()
        await forge(cfg, keys, {H_GROUP: "e0-i0", H_STREAM: stream_name(RUN, EXPERIENCE), H_SERVICE: "reference"})
        await trainer.close()

    asyncio.run(setup())
    [letter] = asyncio.run(list_dead_letters(cfg.nats.url, RUN, options=operator_options(cfg.run_dir)))
    assert letter.service == "rollout" and "RLPIPE_forge_EXPERIENCE" in letter.forged

    refused = rlpipe_command("dead-letters", str(cfg.run_dir), "--reinject", "1")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert refused.stderr.startswith("rlpipe dead-letters: dead letter 1 is not sent back: a dead letter on ")
    assert "the rollout reads only RLPIPE_forge_PROMPTS" in refused.stderr

    async def streams() -> tuple[int, int]:
        trainer = await Bus(as_role(cfg, keys, "trainer"), "trainer").connect()
        counts = [(await trainer.js.stream_info(stream_name(RUN, edge))).state.messages for edge in (EXPERIENCE, DEAD)]
        await trainer.close()
        return counts[0], counts[1]

    assert asyncio.run(streams()) == (0, 1)  # no copy, no record


def test_a_record_id_a_stage_took_first_fails_the_re_inject_instead_of_sending_an_unrecorded_copy(keyed):
    """A rollout publishes under the id the operator's record of a genuine letter will carry: the broker would drop
    the operator's record as a repeat, and a copy without its record would be refused by the trainer as a repeat of
    a dead group. The re-inject sees whose message holds the id and fails, sending nothing."""
    cfg, keys, _ = keyed

    async def scenario() -> tuple[str, int]:
        trainer = await Bus(as_role(cfg, keys, "trainer"), "trainer").connect()
        await genuine_letter(cfg, keys, "reward", "e0-i0", seq=1)
        await forge(cfg, keys, {"Nats-Msg-Id": f"{REINJECT_ID_PREFIX}1.record"})
        with pytest.raises(ReinjectRefused) as refused:
            await reinject(cfg.nats.url, RUN, 1, None, operator_options(cfg.run_dir))
        copies = (await trainer.js.stream_info(stream_name(RUN, "rollouts"))).state.messages
        await trainer.close()
        return str(refused.value), copies

    message, copies = asyncio.run(scenario())

    assert copies == 0
    assert "which another identity published on rlpipe.forge.dead.rollout under the record's id" in message


def test_a_copy_id_a_stage_took_first_fails_the_re_inject_instead_of_reporting_it_sent(keyed):
    """A rollout publishes on ROLLOUTS (its own stream) under the id the operator's copy of a reward's letter will
    carry: the broker drops the operator's copy as a repeat. The re-inject sees the stored copy holds another body
    and fails, rather than noting the copy as sent."""
    cfg, keys, _ = keyed

    async def scenario() -> str:
        trainer = await Bus(as_role(cfg, keys, "trainer"), "trainer").connect()
        await genuine_letter(cfg, keys, "reward", "e0-i0", seq=1)
        nc = await nats.connect(cfg.nats.url, **connect_options(as_role(cfg, keys, "rollout").nats, "rollout"))
        await nc.jetstream().publish(
            subject(RUN, "rollouts"), b"forged", headers={"Nats-Msg-Id": f"{REINJECT_ID_PREFIX}1"}
        )
        await nc.close()
        with pytest.raises(ReinjectRefused) as refused:
            await reinject(cfg.nats.url, RUN, 1, None, operator_options(cfg.run_dir))
        await trainer.close()
        return str(refused.value)

    message = asyncio.run(scenario())
    assert "its copy was dropped as a repeat of RLPIPE_forge_ROLLOUTS message 1, which holds another body" in message


def test_an_older_runs_dead_stream_is_upgraded_at_the_trainers_start_and_its_letters_still_read(
    tiny_model, tmp_path, nats_url
):
    """A DEAD stream an older build made takes only the bare subject, where its letters are: the trainer's start
    adds the roles' subjects, its old letters still settle their groups and list, and new ones land beside them."""
    cfg = load_config(config_file(tmp_path, tiny_model, run_id="old", nats={"url": nats_url}))
    rows = load_jsonl(tiny_model[1] / "train.jsonl")

    async def scenario() -> None:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        older = api.StreamConfig(name=stream_name("old", DEAD), subjects=[subject("old", DEAD)], allow_direct=True)
        await js.add_stream(older)
        old_letter = {H_GROUP: "e0-i0", H_STREAM: stream_name("old", EXPERIENCE), H_SEQ: "4", H_SERVICE: "trainer"}
        await js.publish(subject("old", DEAD), b"old", headers=old_letter)
        trainer = await Bus(cfg, "trainer").connect()  # brings the run's streams up to date
        assert (await js.stream_info(stream_name("old", DEAD))).config.subjects == [
            subject("old", DEAD),
            f"{subject('old', DEAD)}.>",
        ]
        await trainer.dead_letter(StreamMessage(5, b"new", {H_GROUP: "e0-i1"}), "invalid", EXPERIENCE)
        ledger = fed_ledger(3)
        intake = intake_of(trainer, rows, ledger, Progress(step=1))
        assert await intake.catch_up_dead() == 2
        assert sorted(ledger.in_flight) == ["e0-i2"]
        letters = await list_dead_letters(nats_url, "old")
        assert [(d.sequence, d.service, d.group_id, d.forged) for d in letters] == [
            (1, "trainer", "e0-i0", ""),
            (2, "trainer", "e0-i1", ""),
        ]
        await trainer.close()
        await nc.close()

    asyncio.run(scenario())
