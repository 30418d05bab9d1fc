"""Turning a dataset row into the prompt text a model is given.

A row carries either a plain ``prompt`` (fed as it is) or ``messages``, a chat in OpenAI's
role/content form, which is rendered with the model's own chat template and
``add_generation_prompt=True``, so the text ends where the assistant's answer starts (for
SmolLM2: ``...<|im_start|>assistant\\n``). The rendered text holds the template's special
tokens as text; encode it with ``add_special_tokens=False`` (as the rollout and evaluation
do), or a tokenizer that adds BOS would add a second one.

The trainer's feeder and the held-out evaluation both call ``render_rows`` once on the rows
they load, so the rollouts, the reference and the evaluation all see the same prompt text.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase


class ChatTemplateError(ValueError):
    """A chat row the model cannot render: a configuration problem, refused at start."""


class ChatTemplateMissing(ChatTemplateError):
    """A row has ``messages`` but the tokenizer has no chat template to render them with."""


class ChatTemplateRefused(ChatTemplateError):
    """The model's chat template raised on a row's messages (a role it does not take, such as ``tool``)."""


def prompt_text(row: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> str:
    """The text the model completes for one validated row (see ``datasets.row_problem``)."""
    if "messages" not in row:
        return row["prompt"]
    if not tokenizer.chat_template:
        raise ChatTemplateMissing(
            f"row {row.get('id', '?')!r} has 'messages' but the model's tokenizer has no chat template; "
            "give the row a plain 'prompt' or use a chat model"
        )
    try:
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
    except Exception as error:  # jinja2's TemplateError, or whatever a template's raise_exception() raises
        roles = sorted({message["role"] for message in row["messages"]})
        raise ChatTemplateRefused(
            f"row {row.get('id', '?')!r}: the model's chat template cannot render its messages (roles {roles}): "
            f"{error}; rewrite the row with roles the template takes"
        ) from None
    if not isinstance(text, str):  # tokenize=False renders text; transformers types the tokenized forms too
        raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
    return text


def render_rows(rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase) -> list[dict[str, Any]]:
    """New rows whose ``prompt`` is the text to complete; a chat row keeps its ``messages`` beside it.

    Rendered once up front, so the feeder and evaluation need no tokenizer and every later
    reader of ``row["prompt"]`` works unchanged.
    """
    return [{**row, "prompt": prompt_text(row, tokenizer)} for row in rows]
