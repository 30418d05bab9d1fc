"""The long-tail task's data: a quarter of its prompts ask for answers several times the median length, each answer
one number that the reward and the held-out accuracy judge as they judge a plain sum."""

import re
import statistics

import pytest

from services.cli.build.tasks import LONG_REPEATS, LONG_SHARE, make_long_tail_dataset
from services.common.model.datasets import load_jsonl
from services.common.model.evaluation import strict_match
from services.common.model.reward_rules import exact_match

pytestmark = pytest.mark.unit


def test_a_share_of_long_tail_prompts_ask_for_answers_many_times_the_median_length(tmp_path):
    paths = make_long_tail_dataset(tmp_path, seed=0)
    rows = [row for split in ("train", "dev", "eval") for row in load_jsonl(paths[split])]
    assert len({row["id"] for row in rows}) == len(rows) == 4000  # distinct problems, no row in two splits
    long_rows = [row for row in rows if " r" in row["prompt"]]
    assert len(long_rows) == LONG_SHARE * len(rows)
    lengths = [len(row["answer"]) for row in rows]
    median = statistics.median(lengths)
    assert median <= 3 and max(lengths) == 2 * LONG_REPEATS[1]
    assert sum(length >= 5 * median for length in lengths) / len(rows) > 0.15  # a tail, not a few outliers
    for row in long_rows:
        a, b, repeats = map(int, re.fullmatch(r"(\d+)\+(\d+) r(\d+)=", row["prompt"]).groups())
        assert row["answer"] == str(a + b) * repeats and LONG_REPEATS[0] <= repeats <= LONG_REPEATS[1]
        # One number: the reward and the held-out check accept it whole and refuse it cut short.
        assert exact_match(row["answer"], row["answer"], "stop") == 1.0
        assert strict_match(row["answer"], row["answer"])
        assert exact_match(row["answer"][:-2], row["answer"], "length") == 0.0


def test_the_same_seed_writes_the_same_long_tail_splits_and_another_seed_other_ones(tmp_path):
    first = make_long_tail_dataset(tmp_path / "a", seed=0)
    again = make_long_tail_dataset(tmp_path / "b", seed=0)
    other = make_long_tail_dataset(tmp_path / "c", seed=1)
    assert first["train"].read_bytes() == again["train"].read_bytes()
    assert first["train"].read_bytes() != other["train"].read_bytes()
