"""How one batched ``generate`` call ends each row on its own and records the drawn tokens' raw logprobs, step by step
on hand-made tokens (one character per token, "\\0" the EOS), without a model; and which rows share a call."""

import pytest
import torch

from services.common.model.batch_generation import _RawLogprobs, _RowEnds, calls

pytestmark = pytest.mark.unit

EOS, PAD, VOCAB = 0, 32, 128
PROMPTS = ["q</calc>", "q"]  # the first holds a stop string the row must not end on: it is not new text


def decode(tokens: list[int]) -> str:
    return "".join(chr(t) for t in tokens if t != EOS)


def play(texts: list[str], limits: list[int], stop: list[str], scores: torch.Tensor | None = None) -> _RowEnds:
    """Feed ``texts`` (each row's draws, one character a step) to the criterion as ``generate`` would, after the
    left-padded prompts; a finished row draws the pad token. Returns the criterion once every row has ended."""
    prompts = [[ord(c) for c in PROMPTS[i % 2]] for i in range(len(texts))]
    width = max(map(len, prompts))
    rows = [[PAD] * (width - len(p)) + p for p in prompts]
    raw = _RawLogprobs()
    ends = _RowEnds(width, limits, {EOS}, stop, decode, raw, torch.device("cpu"))
    done = torch.zeros(len(texts), dtype=torch.bool)
    for step in range(max(limits)):
        raw(torch.tensor(rows), torch.zeros(len(texts), VOCAB) if scores is None else scores[step])
        for row, text in enumerate(texts):
            drawn = text[step] if step < len(text) and not done[row] else None
            rows[row].append(PAD if drawn is None else 0 if drawn == "\0" else ord(drawn))
        done = ends(torch.tensor(rows), None)
        if done.all():
            break
    assert done.all(), "generate stops at max(limits) at the latest: every row must have ended by then"
    return ends


@pytest.mark.parametrize(
    ("text", "limit", "expected"),
    [
        ("ab</calc>cd", 20, (9, True)),  # through the token that completes the stop string, as vLLM keeps it
        ("ab\0cd</calc>", 20, (3, True)),  # through the end-of-sequence token
        ("abcdefgh", 5, (5, False)),  # the row's own limit, below the batch's longest
        ("ab</calc>", 9, (9, True)),  # a stop on its last allowed token is a stop, not a truncation
    ],
)
def test_each_row_ends_where_a_rollouts_turn_would(text, limit, expected):
    # Beside a row that runs to 20 tokens, so the batch goes on after this row ended.
    ends = play([text, "x" * 20], [limit, 20], ["</calc>"])

    assert (ends.ends[0].item(), ends.stopped[0].item()) == expected
    assert (ends.ends[1].item(), ends.stopped[1].item()) == (20, False)


def test_rows_of_one_batch_end_apart_and_a_finished_rows_padding_is_not_read_as_its_eos():
    # The pad here is a printable token; with the EOS itself as pad (a tokenizer without one) the finished row's
    # padding would look like more EOS tokens: ends are recorded when a row ends, never read back from its tokens.
    ends = play(["a\0", "abcd</calc>", "abcdef"], [10, 12, 4], ["</calc>"])

    assert ends.ends.tolist() == [2, 11, 4]
    assert ends.stopped.tolist() == [True, True, False]


def test_the_recorded_logprob_is_the_drawn_tokens_under_the_raw_logits_of_its_step():
    torch.manual_seed(0)
    scores = torch.randn(3, 1, VOCAB)  # (steps, B, V)
    ends = play(["ab\0"], [3], [], scores)

    recorded = torch.stack(ends.logprobs, dim=1)[0]  # (steps,)
    expected = [scores[step, 0].log_softmax(-1)[token] for step, token in enumerate([ord("a"), ord("b"), EOS])]
    torch.testing.assert_close(recorded, torch.stack(expected))


def test_one_call_takes_every_row_up_to_the_cap_and_above_it_rows_of_like_length_go_together():
    lengths = [5, 9, 5, 9, 7, 7]
    assert calls(lengths, None) == [[0, 1, 2, 3, 4, 5]]
    assert calls(lengths, 6) == [[0, 1, 2, 3, 4, 5]]
    assert calls(lengths, 2) == [[0, 2], [4, 5], [1, 3]]
    # A cap of a group's size over groups of equal prompts keeps each group whole, in one call of its own.
    assert calls([3, 3, 8, 8, 3, 3], 2) == [[0, 1], [4, 5], [2, 3]]
