import pytest

from services.trainer.intake.feeder import PromptFeeder

pytestmark = pytest.mark.unit

ROWS = [{"id": f"r{i}", "prompt": f"{i}+0=", "answer": str(i)} for i in range(5)]


def test_feeder_is_seeded_and_walks_epochs_with_unique_group_ids():
    first = [PromptFeeder(ROWS, seed=3, shuffle=True).next() for _ in range(1)]
    again = PromptFeeder(ROWS, seed=3, shuffle=True)
    prompts = [again.next() for _ in range(12)]
    assert prompts[0].prompt_id == first[0].prompt_id
    assert sorted(p.prompt_id for p in prompts[:5]) == [r["id"] for r in ROWS]  # an epoch covers every row once
    assert len({p.group_id for p in prompts}) == 12
    assert again.cursor == {"epoch": 2, "index": 2}
    assert prompts[5].group_id == "e1-i0"


def test_unshuffled_order_is_the_file_order():
    feeder = PromptFeeder(ROWS, seed=0, shuffle=False)
    assert [feeder.next().answer for _ in range(5)] == ["0", "1", "2", "3", "4"]
