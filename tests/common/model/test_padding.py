"""What rlpipe pads with when a tokenizer names no pad token: its pad, else its EOS, else its unknown token; and the
left-padded batch generation starts from."""

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from services.common.model.padding import ensure_pad_token, left_padded, pad_token_id

pytestmark = pytest.mark.unit

VOCAB = {"<unk>": 0, "<eos>": 1, "<pad>": 2, "a": 3}


def tokenizer(**special: str) -> PreTrainedTokenizerFast:
    """A real fast tokenizer over VOCAB with only the special tokens named."""
    words = Tokenizer(WordLevel(VOCAB, unk_token="<unk>"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, **special)


@pytest.mark.parametrize(
    ("special", "expected"),
    [
        ({"pad_token": "<pad>", "eos_token": "<eos>", "unk_token": "<unk>"}, 2),
        ({"eos_token": "<eos>", "unk_token": "<unk>"}, 1),
        ({"unk_token": "<unk>"}, 0),
    ],
    ids=["its pad token", "no pad: its eos", "no pad, no eos: its unk"],
)
def test_the_pad_id_falls_back_from_pad_to_eos_to_unk(special, expected):
    assert pad_token_id(tokenizer(**special)) == expected


def test_a_tokenizer_with_nothing_to_pad_with_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"no pad, end-of-sequence or unknown token.*give it a pad token"):
        pad_token_id(tokenizer())


def test_ensure_pad_token_sets_the_fallback_so_the_tokenizer_pads_by_itself():
    padless = tokenizer(eos_token="<eos>")
    assert padless.pad_token is None

    assert ensure_pad_token(padless) is padless
    assert (padless.pad_token, padless.pad_token_id) == ("<eos>", 1)
    batch = padless(["a", "a a a"], padding=True)
    assert batch["input_ids"][0] == [3, 1, 1] and batch["attention_mask"][0] == [1, 0, 0]


def test_ensure_pad_token_keeps_a_pad_token_the_tokenizer_has():
    assert ensure_pad_token(tokenizer(pad_token="<pad>", eos_token="<eos>")).pad_token_id == 2


def test_left_padding_masks_the_gaps_and_counts_each_rows_positions_from_its_first_token():
    input_ids, attention_mask, position_ids = left_padded([[5, 6, 7], [8]], pad_id=1)

    assert input_ids.tolist() == [[5, 6, 7], [1, 1, 8]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert position_ids.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert input_ids.dtype == attention_mask.dtype == position_ids.dtype == torch.long


def test_left_padding_to_a_multiple_rounds_the_width_up_and_keeps_each_rows_positions():
    input_ids, attention_mask, position_ids = left_padded([[5, 6, 7], [8]], pad_id=1, multiple=4)

    assert input_ids.tolist() == [[1, 5, 6, 7], [1, 1, 1, 8]]
    assert attention_mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    assert position_ids.tolist() == [[0, 0, 1, 2], [0, 0, 0, 0]]
    assert left_padded([[5, 6, 7, 8]], pad_id=1, multiple=4)[0].tolist() == [[5, 6, 7, 8]]  # already a multiple
