"""Hugging Face datasets (Parquet, Arrow, JSON, save_to_disk), column mapping, streaming, and a cursor that resumes."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.cli.build.tasks import make_arithmetic_dataset
from services.common.config import DataColumns, DataConfig
from services.common.model.datasets import DatasetError, load_jsonl, open_prompts, read_rows, scan_dataset
from services.common.transport.messages import Prompt, decode, encode
from services.trainer.intake.feeder import PromptFeeder
from tests.support.paths import ROOT
from tests.support.runs import LIGHT_RUN, config_file, doctor, doctor_config, run_pipeline

pytestmark = pytest.mark.integration

# The user's own names for what rlpipe calls prompt, answer and id.
THEIR_COLUMNS = {"prompt": "question", "answer": "solution", "id": "uid"}
N_ROWS = 24


def their_rows(tiny_model) -> list[dict]:
    _, data_dir = tiny_model
    rows = load_jsonl(data_dir / "train.jsonl")[:N_ROWS]
    return [{"uid": row["id"], "question": row["prompt"], "solution": row["answer"], "source": "arith"} for row in rows]


def write_source(kind: str, rows: list[dict], folder: Path) -> tuple[Path, bool]:
    """The rows written as ``kind``; returns the path and whether to stream it."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    table = datasets.Dataset.from_list(rows)
    streaming = kind.endswith("-stream")
    kind = kind.removesuffix("-stream")
    if kind == "jsonl":
        path = folder / "train.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif kind == "parquet":
        path = folder / "train.parquet"
        table.to_parquet(str(path))
    elif kind == "json":
        path = folder / "train.json"
        path.write_text(json.dumps(rows))
    elif kind == "save_to_disk":
        path = folder / "saved"
        datasets.DatasetDict({"train": table, "test": table.select(range(4))}).save_to_disk(str(path))
    else:
        assert kind == "arrow"
        table.save_to_disk(str(folder / "saved"))
        [path] = (folder / "saved").glob("*.arrow")
    return path, streaming


SOURCES = ["jsonl", "parquet", "json", "arrow", "save_to_disk", "jsonl-stream", "parquet-stream", "save_to_disk-stream"]


def data_config(path: Path, streaming: bool, **extra) -> DataConfig:
    return DataConfig(train_path=path, columns=THEIR_COLUMNS, streaming=streaming, shuffle_buffer=8, **extra)


# A trainer's feeding as a process: its data config in argv[1], the cursor it resumes from (or "") in argv[2]; one
# line per prompt fed with the cursor after it, which is what a checkpoint keeps
# (services/trainer/checkpointing/recovery.py).
FEEDING = """
import json, sys
import yaml
from services.common.config import DataConfig
from services.cli.build.tasks import make_arithmetic_dataset
from services.common.model.datasets import open_prompts
from services.trainer.intake.feeder import PromptFeeder
data = DataConfig(**yaml.safe_load(open(sys.argv[1])))
feeder = PromptFeeder(open_prompts(data), seed=11, shuffle=True)
if sys.argv[2]:
    feeder.seek(json.loads(sys.argv[2]))
for _ in range(int(sys.argv[3])):
    prompt = feeder.next()
    print(json.dumps({"group": prompt.group_id, "id": prompt.prompt_id, "prompt": prompt.prompt,
                      "cursor": feeder.cursor}), flush=True)
"""


def feeding(config: Path, cursor: dict | None, count: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", FEEDING, str(config), json.dumps(cursor) if cursor else "", str(count)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("kind", SOURCES)
def test_a_feeder_killed_and_resumed_from_its_saved_cursor_feeds_what_an_uninterrupted_one_does(
    kind, tiny_model, tmp_path
):
    rows = their_rows(tiny_model)
    path, streaming = write_source(kind, rows, tmp_path / "data")
    data = data_config(path, streaming)
    # Two and a half epochs: the resume lands mid-epoch and the walk crosses epoch ends after it.
    total, killed_after = N_ROWS * 5 // 2, N_ROWS + 7
    whole = PromptFeeder(open_prompts(data), seed=11, shuffle=True)
    uninterrupted = [whole.next() for _ in range(total)]
    assert sorted(p.prompt_id for p in uninterrupted[:N_ROWS]) == sorted(row["uid"] for row in rows)
    assert [p.prompt for p in uninterrupted[:N_ROWS]] != [row["question"] for row in rows]  # shuffled

    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump(data.model_dump(mode="json")))
    first = feeding(config, None, total)  # it would feed them all; it is killed on the way
    fed = [json.loads(first.stdout.readline()) for _ in range(killed_after)]
    first.send_signal(signal.SIGKILL)
    first.wait()
    second = feeding(config, fed[-1]["cursor"], total - killed_after)
    fed += [json.loads(line) for line in second.communicate(timeout=300)[0].splitlines()]
    assert second.returncode == 0
    assert [(f["group"], f["id"], f["prompt"]) for f in fed] == [
        (p.group_id, p.prompt_id, p.prompt) for p in uninterrupted
    ]


def test_a_seek_one_prompt_back_replays_it_without_rereading_the_stream(tiny_model, tmp_path):
    path, _ = write_source("parquet", their_rows(tiny_model), tmp_path / "data")
    feeder = PromptFeeder(open_prompts(data_config(path, streaming=True)), seed=3, shuffle=True)
    [feeder.next() for _ in range(N_ROWS - 1)]
    cursor = feeder.cursor
    last_of_epoch = feeder.next()
    feeder.seek(cursor)  # the publish failed: the same prompt again
    assert feeder.next() == last_of_epoch
    assert feeder.next().group_id == "e1-i0"


def test_columns_are_mapped_and_rendered_by_the_given_function(tiny_model, tmp_path):
    path, _ = write_source("parquet", their_rows(tiny_model), tmp_path / "data")
    data = DataConfig(train_path=path, columns=THEIR_COLUMNS, shuffle=False)
    feeder = PromptFeeder(open_prompts(data, render=lambda row: "Q: " + row["prompt"]), seed=0, shuffle=False)
    first = feeder.next()
    expected = their_rows(tiny_model)[0]
    assert (first.prompt_id, first.prompt, first.answer) == (
        expected["uid"],
        "Q: " + expected["question"],
        expected["solution"],
    )


@pytest.mark.unit
def test_rewriting_the_built_in_splits_leaves_a_reader_of_the_old_file_whole_lines(tmp_path):
    """pytest workers share build/test-model: one rebuilding the data must not tear a file another is reading."""
    paths = make_arithmetic_dataset(tmp_path, seed=0)
    before = paths["train"].stat().st_ino
    make_arithmetic_dataset(tmp_path, seed=0)
    assert paths["train"].stat().st_ino == before, "identical splits were written again"

    with paths["train"].open("rb") as reader:
        make_arithmetic_dataset(tmp_path, seed=1)
        old_rows = [json.loads(line) for line in reader]
    assert paths["train"].stat().st_ino != before
    assert len(old_rows) == 10_000 - 500 - 300
    assert [row["id"] for row in old_rows] != [row["id"] for row in load_jsonl(paths["train"])]


@pytest.mark.unit
def test_chat_rows_from_a_messages_column(tmp_path):
    import datasets

    chat = [{"role": "user", "content": "Tom has 2 apples and buys 3 more. How many?"}]
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list([{"conversation": chat, "gold": "5"}]).to_parquet(str(path))
    columns = DataColumns(messages="conversation", answer="gold")
    assert read_rows(path, columns) == [{"answer": "5", "messages": chat}]


@pytest.mark.unit
def test_a_rows_info_column_reaches_the_prompt_its_environment_resets_from(tmp_path):
    import datasets

    rows = [
        {"question": "Guess the number.", "gold": "7", "setup": {"seed": 11, "hint": "odd"}},
        {"question": "Guess the number.", "gold": "4", "setup": {"seed": 12, "hint": "even"}},
    ]
    path = tmp_path / "games.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    columns = DataColumns(prompt="question", answer="gold", info="setup")
    assert [row["info"] for row in read_rows(path, columns)] == [r["setup"] for r in rows]
    prompt = PromptFeeder(read_rows(path, columns), seed=0, shuffle=False).next()
    assert decode(encode(prompt), Prompt).info == {"seed": 11, "hint": "odd"}  # on the wire to the rollout

    # Text holding an object (a CSV cell) is one; under the default name anything else is no environment's info
    # and is left out, so a dataset with an unrelated "info" column still loads.
    lines = [{"info": '{"seed": 3}'}, {"info": [11, "odd"]}, {"info": "easy"}]
    (tmp_path / "mixed.jsonl").write_text(
        "".join(json.dumps({"prompt": "Guess.", "answer": "7"} | r) + "\n" for r in lines)
    )
    assert [row.get("info") for row in read_rows(tmp_path / "mixed.jsonl", DataColumns())] == [{"seed": 3}, None, None]
    # Under a name the config sets, a value that is not an object is the row's fault, reported at start.
    with pytest.raises(DatasetError, match="2 bad of 3 lines: line 2: field 'info' must be a JSON object"):
        read_rows(tmp_path / "mixed.jsonl", DataColumns(info="info"))


def test_unusable_rows_are_reported_at_start_with_their_index_and_reason(tiny_model, tmp_path):
    rows = their_rows(tiny_model)
    rows[3]["solution"] = None
    rows[17]["question"] = None
    path, _ = write_source("parquet", rows, tmp_path / "data")
    with pytest.raises(DatasetError) as refused:
        open_prompts(data_config(path, streaming=False))
    assert str(refused.value) == (
        f"{path}: 2 bad of {N_ROWS} rows: row 3: missing or non-string field 'solution'; "
        "row 17: missing or non-string field 'question' (or give 'messages')"
    )
    scan = scan_dataset(path, DataColumns(**THEIR_COLUMNS), limit=10, streaming=True)
    assert (scan.checked, scan.truncated, scan.bad) == (10, True, [(3, "missing or non-string field 'solution'")])


def test_a_dataset_without_the_columns_or_the_split_names_what_it_has(tiny_model, tmp_path):
    path, _ = write_source("save_to_disk", their_rows(tiny_model), tmp_path / "data")
    with pytest.raises(DatasetError, match=r"no column 'prompt' \(data.columns.prompt\) or 'messages'.*'question'"):
        read_rows(path, DataColumns(answer="solution"))
    with pytest.raises(DatasetError, match=r"has no split 'validation' \(it has \['test', 'train'\]\); set data.split"):
        read_rows(path, DataColumns(**THEIR_COLUMNS), split="validation")
    assert len(read_rows(path, DataColumns(**THEIR_COLUMNS), split="test")) == 4
    with pytest.raises(DatasetError, match=r"cannot tell the format from '.txt'"):
        (tmp_path / "rows.txt").write_text("1+1=")
        read_rows(tmp_path / "rows.txt", DataColumns())


def test_doctor_names_the_unusable_rows_of_a_parquet_dataset(tiny_model, tmp_path, nats_url):
    rows = their_rows(tiny_model)
    rows[5]["question"] = None
    path, _ = write_source("parquet", rows, tmp_path / "data")
    done = doctor(
        doctor_config(tmp_path, tiny_model, nats_url, data={"train_path": str(path), "columns": THEIR_COLUMNS})
    )
    assert done.returncode == 1
    [line] = [line for line in done.stdout.splitlines() if line.startswith("FAIL dataset data.train_path:")]
    assert f"{path}: 1 bad of {N_ROWS} rows: row 5: missing or non-string field 'question' (or give 'messages')" in line


@pytest.mark.e2e
def test_a_run_trains_on_a_parquet_dataset_with_its_own_column_names(tiny_model, tmp_path):
    import datasets

    _, data_dir = tiny_model

    def parquet(split: str, count: int) -> tuple[Path, list[dict]]:
        rows = [
            {"uid": row["id"], "question": row["prompt"], "solution": row["answer"]}
            for row in load_jsonl(data_dir / f"{split}.jsonl")[:count]
        ]
        path = tmp_path / f"{split}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        return path, rows

    (train, train_rows), (held_out, _) = parquet("train", 200), parquet("eval", 40)
    config = config_file(
        tmp_path,
        tiny_model,
        data={"train_path": str(train), "eval_path": str(held_out), "columns": THEIR_COLUMNS, "eval_size": 40},
        train={"total_steps": 2, "batch_size": 4, "learning_rate": 1e-3, "max_seq_len": 32},
        checkpoint={"save_every_steps": 0},
        **LIGHT_RUN,
    )
    done, metrics = run_pipeline(config)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [row.step for row in metrics if row.is_step] == [1, 2]
    assert [row.step for row in metrics if row.is_eval] == [0, 2]  # before and after, on the Parquet
    answers = {row["question"]: row["solution"] for row in train_rows}
    fed = [json.loads(line) for line in (tmp_path / "runs" / "test" / "samples" / "step_1.jsonl").open()]
    assert len(fed) == 4
    assert all(answers[group["prompt"]] == group["answer"] for group in fed)


@pytest.mark.unit
def test_a_chat_row_whose_roles_the_template_refuses_is_refused_at_open_however_deep_in_the_file(tmp_path):
    from services.common.model.chat import ChatTemplateRefused

    user = {"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"}
    tool = {
        "id": "deep",
        "messages": [*user["messages"], {"role": "tool", "content": "2"}, {"role": "user", "content": "so?"}],
        "answer": "2",
    }
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({**user, "id": f"u{i}"}) + "\n" for i in range(50)) + json.dumps(tool) + "\n")
    rendered: list[str] = []

    def render(row):
        if any(message["role"] == "tool" for message in row["messages"]):
            raise ChatTemplateRefused(f"row {row['id']!r}: no tool role")
        rendered.append(row["id"])
        return "text"

    with pytest.raises(ChatTemplateRefused, match="row 'deep'"):
        open_prompts(DataConfig(train_path=path), render=render)
    assert rendered == ["u0"]  # one row of each set of roles is tried, not every row
