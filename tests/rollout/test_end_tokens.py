"""Which tokens end a generation: the tokenizer's EOS and every end token the model's generation config lists, as
vLLM stops on them; the episode loop reads each as the model closing its message."""

import json

import pytest

from services.rollout.engines import end_token_ids

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("listed", "expected"),
    [([2, 7], {2, 7}), (7, {2, 7}), (None, {2}), ("absent", {2})],
    ids=["a list", "one id", "null", "no generation config"],
)
def test_the_end_tokens_are_the_tokenizers_eos_and_every_one_the_generation_config_lists(tmp_path, listed, expected):
    if listed != "absent":
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))
    assert end_token_ids(tmp_path, eos_token_id=2) == frozenset(expected)
