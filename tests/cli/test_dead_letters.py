"""`rlpipe dead-letters` lists DEAD with reasons and re-injects a fixed message into its origin stream, recording
the re-inject in DEAD beside the letter."""

import asyncio
import contextlib
import json
import time
from pathlib import Path

import msgpack
import nats
import numpy as np
import pytest
from nats.js.errors import NotFoundError

from services.cli.dead_letters import list_dead_letters, operator_options, reinject
from services.common.observe import metrics as m
from services.common.transport.bus import Bus
from services.common.transport.messages import Prompt, decode, encode
from services.common.transport.streams import (
    ANY_SUBJECT,
    DEAD,
    EXPERIENCE,
    H_GROUP,
    H_REINJECT_SENT,
    H_REINJECTED,
    H_STREAM,
    PROMPTS,
    stream_name,
    subject,
)
from services.trainer.checkpointing.lineage import Lineage, ReopenedRecord, StepRecord, effective_steps
from tests.support.messages import completion, experience_group, prompt
from tests.support.runs import (
    config_file,
    kill_service,
    metric_rows,
    rlpipe,
    rlpipe_command,
    run_config,
    run_info,
    running_pipeline,
    wait_for,
)
from tests.support.servers import free_port

pytestmark = pytest.mark.integration


async def rollout_bus(cfg) -> Bus:
    """A bus of PROMPTS's reader, whose dead letters go on dead.rollout, once the trainer made the streams."""
    await (await Bus(cfg, "trainer").connect()).close()
    return await Bus(cfg, "rollout").connect()


def test_dead_letters_of_a_finished_run_say_so_in_one_line_without_a_traceback(tmp_path):
    run_dir = tmp_path / "runs" / "done"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"nats_url": f"nats://127.0.0.1:{free_port()}"}))  # nobody there
    (run_dir / "exit.json").write_text(json.dumps({"state": "finished", "code": 0}))
    done = rlpipe_command("dead-letters", str(run_dir))
    assert done.returncode == 2
    assert (
        done.stderr.startswith("rlpipe dead-letters: no broker answers at nats://127.0.0.1:")
        and "run done is finished" in done.stderr
    )
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_list_and_reinject(tiny_model, tmp_path, nats_url):
    runs = tmp_path / "runs"
    cfg = run_config(tmp_path, tiny_model, run_id="dl", nats={"url": nats_url})
    run_dir = runs / "dl"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"nats_url": nats_url}))

    async def dead_letter_one_bad_prompt() -> None:
        bus = await rollout_bus(cfg)
        await bus.js.publish(subject("dl", PROMPTS), msgpack.packb({"v": 1, "kind": "prompt"}))
        queue = await bus.work_queue(PROMPTS)
        [msg] = await queue.fetch(1, timeout=5)
        await bus.dead_letter(msg, "invalid Prompt: group_id missing", PROMPTS)
        await msg.term()
        await bus.close()

    asyncio.run(dead_letter_one_bad_prompt())
    listed = rlpipe_command("dead-letters", str(run_dir), "--json")
    assert listed.returncode == 0, listed.stderr
    [letter] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert letter["reason"] == "invalid Prompt: group_id missing" and letter["origin_stream"] == stream_name(
        "dl", PROMPTS
    )
    assert letter["service"] == "rollout" and letter["origin_sequence"] == 1 and letter["forged"] == ""
    table = rlpipe_command("dead-letters", str(run_dir))
    assert "dead letters of dl: 1" in table.stdout

    fixed = tmp_path / "fixed.msgpack"
    fixed.write_bytes(encode(prompt("e0-i0", prompt_id="p")))
    sent = rlpipe_command("dead-letters", str(run_dir), "--reinject", str(letter["sequence"]), "--payload", str(fixed))
    assert sent.returncode == 0, sent.stderr

    async def read_back() -> Prompt:
        bus = await Bus(cfg, "test").connect()
        queue = await bus.work_queue(PROMPTS)
        [msg] = await queue.fetch(1, timeout=5)
        await msg.ack_sync()
        await bus.close()
        return decode(msg.data, Prompt)

    assert asyncio.run(read_back()).group_id == "e0-i0"
    # The letter stays, marked with the record of its re-inject; the record names the fixed body's group, which
    # the trainer reopens when it reads it.
    [kept] = asyncio.run(list_dead_letters(nats_url, "dl"))
    assert (kept.sequence, kept.reinjected_at) == (letter["sequence"], 2)

    async def record() -> dict[str, str]:
        bus = await Bus(cfg, "test").connect()
        raw = await bus.js.get_msg(stream_name("dl", DEAD), seq=2)
        await bus.close()
        return dict(raw.headers)

    headers = asyncio.run(record())
    assert headers[H_REINJECTED] == str(letter["sequence"]) and headers[H_GROUP] == "e0-i0"
    assert headers[H_STREAM] == stream_name("dl", PROMPTS)


def test_a_re_inject_stopped_half_way_is_completed_by_running_it_again_and_a_done_one_is_reported_done(
    config_only_model, tmp_path, nats_url
):
    cfg = run_config(tmp_path, config_only_model, run_id="dl", nats={"url": nats_url})
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"nats_url": nats_url}))
    fixed = tmp_path / "fixed.msgpack"
    fixed.write_bytes(encode(prompt("e0-i0", prompt_id="p")))
    again = ("--reinject", "1", "--payload", str(fixed))

    async def dead_letter_a_prompt_and_refuse_copies() -> None:
        bus = await rollout_bus(cfg)
        await bus.js.publish(subject("dl", PROMPTS), msgpack.packb({"v": 1, "kind": "prompt"}))
        [msg] = await (await bus.work_queue(PROMPTS)).fetch(1, timeout=5)
        await bus.dead_letter(msg, "invalid Prompt: group_id missing", PROMPTS)
        await msg.term()
        await max_message_size(bus, 8)  # PROMPTS refuses the copy: the second publish of a re-inject fails
        await bus.close()

    async def max_message_size(bus: Bus, size: int) -> None:
        info = await bus.js.stream_info(stream_name("dl", PROMPTS))
        info.config.max_msg_size = size
        await bus.js.update_stream(info.config)

    async def streams() -> tuple[list[dict[str, str]], int]:
        bus = await Bus(cfg, "test").connect()
        dead, seq = [], 2  # after the letter
        with contextlib.suppress(NotFoundError):
            while True:
                raw = await bus.js.get_msg(stream_name("dl", DEAD), seq=seq, subject=ANY_SUBJECT, next=True)
                dead.append(dict(raw.headers))
                seq = raw.seq + 1
        prompts = (await bus.js.stream_info(stream_name("dl", PROMPTS))).state.messages
        await bus.close()
        return dead, prompts

    asyncio.run(dead_letter_a_prompt_and_refuse_copies())
    failed = rlpipe_command("dead-letters", str(run_dir), *again)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    assert "its re-inject record is stored (DEAD 2) but the copy could not be sent" in failed.stderr
    assert "Run the same command again" in failed.stderr
    dead, prompts = asyncio.run(streams())
    assert prompts == 0 and len(dead) == 1
    [record] = dead
    assert record[H_REINJECTED] == "1" and H_REINJECT_SENT not in record
    [listed] = asyncio.run(list_dead_letters(nats_url, "dl"))
    assert (listed.reinjected_at, listed.reinject_sent) == (2, False)

    async def accept_copies() -> None:
        bus = await Bus(cfg, "test").connect()
        await max_message_size(bus, -1)
        await bus.close()

    asyncio.run(accept_copies())
    completed = rlpipe_command("dead-letters", str(run_dir), *again)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("completed the re-inject of dead letter 1 into RLPIPE_dl_PROMPTS")
    dead, prompts = asyncio.run(streams())  # one record, one copy, and the note that the copy went
    assert prompts == 1 and len(dead) == 2
    [record, note] = dead
    assert record[H_REINJECTED] == "1" and note[H_REINJECT_SENT] == "1"

    done = rlpipe_command("dead-letters", str(run_dir), *again)
    assert done.returncode == 0, done.stderr
    assert "dead letter 1 was re-injected into RLPIPE_dl_PROMPTS already (its record: DEAD 2)" in done.stdout
    assert asyncio.run(streams())[1] == 1

    # A copy the broker took whose answer never came back (the note was never written): reported as sent already.
    async def lose_the_note() -> None:
        bus = await Bus(cfg, "test").connect()
        await bus.js.delete_msg(stream_name("dl", DEAD), 3)
        await bus.close()

    asyncio.run(lose_the_note())
    [listed] = asyncio.run(list_dead_letters(nats_url, "dl"))
    assert (listed.reinjected_at, listed.reinject_sent) == (2, False)
    retried = rlpipe_command("dead-letters", str(run_dir), *again)
    assert retried.returncode == 0, retried.stderr
    assert "was re-injected into RLPIPE_dl_PROMPTS already" in retried.stdout
    assert asyncio.run(streams())[1] == 1  # the duplicate window dropped the repeat
    [listed] = asyncio.run(list_dead_letters(nats_url, "dl"))
    assert (listed.reinjected_at, listed.reinject_sent) == (2, True)


def experience_body(group_id: str, dtype: type) -> bytes:
    """An EXPERIENCE body that decodes; with float token ids it would break the learner."""
    answer = completion(np.asarray([5, 2], dtype=dtype), text="2")
    references = [np.full(2, -0.5, np.float32)]
    return encode(experience_group(group_id, [1.0], references, completions=[answer], prompt_ids=[3]))


@pytest.mark.e2e
def test_a_re_injected_group_is_applied_once_and_a_killed_trainer_restarts_past_its_dead_letter(tiny_model, tmp_path):
    """A group whose EXPERIENCE breaks the learner (float token ids) goes to DEAD; the operator re-injects a fixed
    copy; the trainer reopens the group and applies it. SIGKILLed after that, the trainer comes back (the launcher
    restarts it: DEAD read at start is no lost broker state) and the group stays applied exactly once in the steps
    that make up the final model. The run has no end of its own (a short one could finish before the kill): the
    operator stops it."""
    runs = tmp_path / "runs"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="reinj",
        train={"total_steps": 100_000, "batch_size": 8, "max_inflight_batches": 2, "max_staleness": None},
        checkpoint={"save_every_steps": 2, "keep_last": 10},
        nats={"duplicate_window_s": 600},
        supervision={"backoff_s": 0.5},
    )
    run_dir = runs / "reinj"
    group_id = "e0-i9000"  # past what the test's steps feed (1,125 steps): only the copies below ever carry it
    with running_pipeline(config) as run:
        steps = lambda: [r for r in metric_rows(run_dir) if r.is_step]  # noqa: E731
        wait_for(lambda: len(steps()) >= 1, "the first step", run)
        url, operator = run_info(run_dir, run)["nats_url"], operator_options(run_dir)

        async def send_bad() -> None:
            nc = await nats.connect(url, **operator)
            body = experience_body(group_id, np.float32)
            # Headers as the reference stage sets them (Bus.publish): the group id, and no incarnation (the body has
            # none either), so the trainer takes the group for one of its own.
            await nc.jetstream().publish(subject("reinj", EXPERIENCE), body, headers={H_GROUP: group_id})
            await nc.close()

        asyncio.run(send_bad())
        letters = lambda: asyncio.run(list_dead_letters(url, "reinj", 100, operator))  # noqa: E731
        wait_for(lambda: len(letters()) == 1, "the dead letter", run)
        [letter] = letters()
        assert letter.group_id == group_id and "token_ids are float32, not integers" in letter.reason
        fixed = experience_body(group_id, np.int32)
        sent = asyncio.run(reinject(url, "reinj", letter.sequence, fixed, operator))
        assert sent.origin == stream_name("reinj", EXPERIENCE)
        applied = lambda: [g for r in steps_in_lineage(run_dir) for g, _ in r.groups if g == group_id]  # noqa: E731
        wait_for(lambda: applied() == [group_id], "the re-injected group applied", run)
        # The ledger's metrics count the group dead once and reopened once (so the fates still add up to the fed).
        counted = lambda metric: sum(r.get(metric) or 0 for r in steps())  # noqa: E731
        wait_for(lambda: counted(m.GROUPS_REOPENED) == 1, "the reopen in the metrics", run)
        assert counted(m.GROUPS_DEAD) == 1
        [kept] = letters()  # the letter stays in DEAD, marked as re-injected
        assert kept.sequence == letter.sequence and kept.reinjected_at == letter.sequence + 1
        killed_at = time.time()
        kill_service(run_dir, "trainer", run)
        wait_for(lambda: restarts(run_dir).get("trainer") == 1, "trainer restart", run)
        wait_for(lambda: any(r[m.TIME] > killed_at for r in steps()), "a step after the restart", run)
        # run.json names the restarted trainer's admin endpoint once the launcher has seen it ready, which can come
        # after its first step.
        wait_for(lambda: run_info(run_dir, run)["admin"] is not None, "the restarted trainer's admin endpoint", run)
        assert rlpipe(run_dir, "stop").returncode == 0
        output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output[-4000:]
    assert restarts(run_dir) == {"trainer": 1}
    records = Lineage(run_dir / "lineage.jsonl").records()
    # Once, or again by the resumed trainer when its checkpoint is older than the reopen: either way this letter's.
    assert {(r.reopened, r.dead_letter) for r in records if isinstance(r, ReopenedRecord)} == {
        (group_id, letter.sequence)
    }
    final = effective_steps(records)
    assert [r.step for r in final] == list(range(1, steps()[-1].step + 1))
    assert [g for r in final for g, _ in r.groups].count(group_id) == 1


def steps_in_lineage(run_dir: Path) -> list[StepRecord]:
    return effective_steps(Lineage(run_dir / "lineage.jsonl").records())


def restarts(run_dir: Path) -> dict[str, int]:
    return json.loads((run_dir / "run.json").read_text())["restarts"]
