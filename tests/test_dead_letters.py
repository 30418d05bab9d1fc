"""`rlpipe dead-letters` lists DEAD with reasons and re-injects a fixed message into its origin stream, recording
the re-inject in DEAD beside the letter."""

import asyncio
import json
import subprocess
import sys

import msgpack

from services.common.bus import DEAD, H_GROUP, H_REINJECTED, H_STREAM, PROMPTS, Bus, stream_name, subject
from services.common.config import load_config
from services.common.messages import Prompt, decode, encode
from services.dead_letters import list_dead_letters
from tests.conftest import ROOT, write_config


def test_list_and_reinject(tiny_model, tmp_path, nats_url):
    model_dir, data_dir = tiny_model
    runs = tmp_path / "runs"
    cfg = load_config(write_config(tmp_path / "c.yaml", model_dir, data_dir, runs, run_id="dl", nats={"url": nats_url}))
    run_dir = runs / "dl"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"nats_url": nats_url}))

    async def dead_letter_one_bad_prompt() -> None:
        bus = await Bus(cfg, "test").connect()
        await bus.js.publish(subject("dl", PROMPTS), msgpack.packb({"v": 1, "kind": "prompt"}))
        queue = await bus.work_queue(PROMPTS)
        [msg] = await queue.fetch(1, timeout=5)
        await bus.dead_letter(msg, "invalid Prompt: group_id missing", PROMPTS)
        await msg.term()
        await bus.close()

    asyncio.run(dead_letter_one_bad_prompt())
    listed = subprocess.run(
        [sys.executable, "-m", "services.cli", "dead-letters", str(run_dir), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    [letter] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert letter["reason"] == "invalid Prompt: group_id missing" and letter["origin_stream"] == stream_name(
        "dl", PROMPTS
    )
    assert letter["service"] == "test" and letter["origin_sequence"] == 1
    table = subprocess.run(
        [sys.executable, "-m", "services.cli", "dead-letters", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "dead letters of dl: 1" in table.stdout

    fixed = tmp_path / "fixed.msgpack"
    fixed.write_bytes(encode(Prompt(group_id="e0-i0", prompt_id="p", prompt="1+1=", answer="2")))
    sent = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "dead-letters",
            str(run_dir),
            "--reinject",
            str(letter["sequence"]),
            "--payload",
            str(fixed),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
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
