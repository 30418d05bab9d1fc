"""Multi-turn episodes without a model: a character tokenizer (one id per character) and an engine that answers
each turn from a script, deterministic to the token, with the episode limits the episode tests share."""

from __future__ import annotations

import numpy as np

from services.common.episodes.generation import Generation
from services.common.episodes.runner import EpisodeLimits

EOS = 0
MERGED = 1000  # a token the stub engine samples for "ab" that encoding "ab" never gives: re-tokenizing would lose it
SAMPLED_LOGPROB = -0.5
LIMITS = EpisodeLimits(
    max_turns=4, max_tokens_per_turn=40, max_total_tokens=200, max_observation_tokens=40, max_seq_len=400
)


class CharTokenizer:
    eos_token_id = EOS

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded.append(text)
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("ab" if t == MERGED else chr(t) for t in token_ids if t != EOS)


class ScriptedEngine:
    """Each call continues every context with the next line of ``script`` for its turn (how many model turns the
    context already holds, counted by its ``</calc>``s), cut at the call's max tokens; records each call."""

    def __init__(self, script: list[str], tokenizer: CharTokenizer):
        self.script = script
        self.tokenizer = tokenizer
        self.calls: list[list[list[int]]] = []

    async def generate(self, contexts: list[list[int]], max_tokens: list[int]) -> list[Generation]:
        self.calls.append([list(c) for c in contexts])
        out = []
        for context, limit in zip(contexts, max_tokens, strict=True):
            text = self.script[min(self.tokenizer.decode(context).count("</calc>"), len(self.script) - 1)]
            ids = [EOS if c == "\0" else MERGED if c == "\1" else ord(c) for c in text][:limit]
            out.append(
                Generation(
                    text=self.tokenizer.decode(ids),
                    token_ids=np.asarray(ids, dtype=np.int32),
                    logprobs=np.full(len(ids), SAMPLED_LOGPROB, dtype=np.float32),
                    finish_reason="stop" if ids[-1] == EOS else "length",
                )
            )
        return out
