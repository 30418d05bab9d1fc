"""data.tokenize_workers: prompts rendered and tokenized on a pool of processes give exactly what one process
gives, in order, for whole lists, for a walk over a dataset, and in the feeder (services/common/model/preprocess.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from services.common.config import DataConfig
from services.common.model.chat import ChatTemplateRefused, prompt_text
from services.common.model.datasets import open_prompts
from services.common.model.modeling import load_tokenizer
from services.common.model.preprocess import CHUNK_ROWS, Preprocessor
from services.trainer.intake.feeder import PromptFeeder
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration

# A template that refuses a role, as many models' do for "tool".
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    """The tiny model's tokenizer with a chat template, as a folder the workers load it from."""
    model_dir, _ = tiny_model
    folder = tmp_path_factory.mktemp("chat-model")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


def chats(count: int) -> list[dict]:
    return [
        {"id": str(i), "messages": [{"role": "user", "content": f"{i}+{i % 7}="}], "answer": str(i + i % 7)}
        if i % 3
        else {"id": str(i), "prompt": f"{i}*2=", "answer": str(2 * i)}
        for i in range(count)
    ]


def test_two_workers_render_and_tokenize_exactly_as_one_process_does(chat_model):
    tokenizer = load_tokenizer(chat_model)
    rows = chats(3 * CHUNK_ROWS + 5)  # several chunks and a ragged last one
    inline, pooled = Preprocessor(tokenizer, chat_model, 1), Preprocessor(tokenizer, chat_model, 2)
    try:
        assert pooled.pool is not None and inline.pool is None
        texts = inline.render(rows)
        assert texts[1] == "[user]1+1=[assistant]" and texts[0] == "0*2="
        assert pooled.render(rows) == texts
        ids = inline.encode(texts)
        assert pooled.encode(texts) == ids
        assert asyncio.run(pooled.encode_async(texts)) == ids
        walk = [None if i % 50 == 0 else row for i, row in enumerate(rows)]  # unusable streamed rows stay None
        expected = [None if row is None else prompt_text(row, tokenizer) for row in walk]
        assert list(pooled.rendered_ahead(iter(walk))) == expected
        refused = [*rows[:200], {"id": "t", "messages": [{"role": "tool", "content": "x"}], "answer": "1"}]
        with pytest.raises(ChatTemplateRefused, match="row 't': the model's chat template cannot render"):
            pooled.render(refused)
    finally:
        pooled.close()


def test_a_feeder_over_rows_rendered_ahead_feeds_what_one_rendering_as_it_goes_feeds(chat_model, tmp_path):
    tokenizer = load_tokenizer(chat_model)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in chats(700)))
    data = DataConfig(train_path=path)
    render = partial(prompt_text, tokenizer=tokenizer)
    pooled = Preprocessor(tokenizer, chat_model, 2)
    try:
        inline = PromptFeeder(open_prompts(data, render=render), seed=5, shuffle=True)
        ahead = PromptFeeder(
            open_prompts(data, render=render, render_ahead=pooled.rendered_ahead), seed=5, shuffle=True
        )
        for feeder in (inline, ahead):
            feeder.seek({"epoch": 0, "index": 650})  # a resume near the end: the walk goes on into epoch 1
        fed = [(inline.next(), ahead.next()) for _ in range(120)]
        assert all(a == b for a, b in fed) and fed[-1][0].group_id == "e1-i69"
        assert any(a.prompt.startswith("[user]") for a, _ in fed)
    finally:
        pooled.close()


ROLE = """
import os, sys, time
from pathlib import Path
from services.common.model.modeling import load_tokenizer
from services.common.model.preprocess import Preprocessor

path = Path(sys.argv[1])
pool = Preprocessor(load_tokenizer(path), path, 2).start().pool
print(*sorted({pool.submit(os.getpid).result() for _ in range(8)}), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its parent has not reaped it yet


def test_the_workers_and_their_fork_server_end_when_the_role_is_killed(chat_model):
    role = subprocess.Popen([sys.executable, "-c", ROLE, str(chat_model)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in role.stdout.readline().split()]
        assert workers and all(alive(pid) for pid in workers)
        server = int(Path(f"/proc/{workers[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert server != role.pid and alive(server)  # the workers' parent is the fork server, not the role
        role.kill()
        role.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in [*workers, server]):
            assert time.monotonic() < deadline, [pid for pid in [*workers, server] if alive(pid)]
            time.sleep(0.2)
    finally:
        role.kill()
