"""A reward model: a Hugging Face sequence classifier scoring (prompt, completion) pairs in batches.

Any ``AutoModelForSequenceClassification`` folder works. With one label its logit is the score;
with two, the logit of label 1 ("right") minus that of label 0 (the log-odds of right). With
``normalize`` the score goes through a sigmoid into (0, 1), the range of the rule functions it is
added to. A tokenizer with a chat template sees the pair as a user turn and an assistant turn;
otherwise the completion is appended to the prompt, as the policy saw it. Pairs longer than
``max_length`` lose their start, so the answer being judged is always kept.

Each reward replica loads its own copy (on its GPU with ``device: auto``), so replicas scale out
like any other stage.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from services.common.config import ConfigError, RewardModelConfig
from services.common.model.padding import ensure_pad_token


def model_device(name: str, cuda_available: bool | None = None) -> torch.device:
    """``reward.model.device`` as a torch device: auto is CUDA when this replica sees a GPU."""
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if name == "cuda" and not available:
        raise ConfigError(
            "invalid configuration:\n  reward.model.device: 'cuda' but this replica sees no CUDA device; "
            "use auto or cpu, or run it where a GPU is visible"
        )
    return torch.device("cuda" if name == "cuda" or (name == "auto" and available) else "cpu")


def forward_spans(count: int, batch_size: int, group_sizes: list[int] | None = None) -> list[tuple[int, int]]:
    """The [start, end) of ``count`` pairs each forward pass takes: ``batch_size`` at a time, and with
    ``group_sizes`` (consecutive groups' pair counts, summing to ``count``; train.deterministic) never two groups'
    pairs in one pass: a pair's score depends, in its last bits, on how far its pass is padded, and so on the other
    pairs in it."""
    spans, start = [], 0
    for size in group_sizes if group_sizes is not None else [count]:
        spans += [(first, min(first + batch_size, start + size)) for first in range(start, start + size, batch_size)]
        start += size
    return spans


class RewardModel:
    """``score(pairs)`` -> one float per (prompt, completion); loaded once per replica."""

    def __init__(self, cfg: RewardModelConfig):
        self.cfg = cfg
        self.device = model_device(cfg.device)
        self.tokenizer = ensure_pad_token(AutoTokenizer.from_pretrained(str(cfg.path)))  # pad, else eos, else unk
        self.tokenizer.truncation_side = "left"  # keep the completion: it is what is judged
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(str(cfg.path)).to(self.device).eval()
        if self.model.config.pad_token_id is None:  # the classifier reads the last token that is not padding
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        labels = self.model.config.num_labels
        if labels not in (1, 2):
            raise ConfigError(
                f"invalid configuration:\n  reward.model.path: {str(cfg.path)!r} has {labels} labels; "
                "a reward model has 1 (a score) or 2 (wrong, right)"
            )

    def render(self, prompt: str, completion: str) -> str:
        if self.tokenizer.chat_template:
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(turns, tokenize=False)
        return prompt + completion

    @torch.inference_mode()
    def score(self, pairs: list[tuple[str, str]], group_sizes: list[int] | None = None) -> np.ndarray:
        """``[len(pairs)]`` float32 scores, in the forward passes ``forward_spans`` plans."""
        scores = []
        for start, end in forward_spans(len(pairs), self.cfg.batch_size, group_sizes):
            texts = [self.render(*pair) for pair in pairs[start:end]]
            encoded = self.tokenizer(
                texts, return_tensors="pt", padding=True, truncation=True, max_length=self.cfg.max_length
            ).to(self.device)
            logits = self.model(**encoded).logits.float()  # (B, labels)
            logit = logits[:, 0] if logits.shape[-1] == 1 else logits[:, 1] - logits[:, 0]  # (B,)
            scores.append(torch.sigmoid(logit) if self.cfg.normalize else logit)
        return torch.cat(scores).cpu().numpy().astype(np.float32) if scores else np.zeros(0, np.float32)
