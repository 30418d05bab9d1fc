"""How an environment's observation becomes tokens after the model's turn, and whether the model's end-of-sequence
token ends the episode (``rollout.observation_role``).

Verbatim (the default): the observation's text is tokenized alone and appended where the model stopped, so a
tool result continues the model's own message (``<calc>2*3</calc><result>6</result>``); the model's EOS means it
has answered, and ends the episode.

As a chat message: a chat model ends each message with EOS (SmolLM2's ``<|im_end|>``), a tool call included, and
reads a tool's reply as a message of its own. With ``rollout.observation_role`` set, the model's EOS ends its
turn, not the episode (the environment's ``done`` does), and the observation is wrapped as the model's chat
template wraps a message of that role, followed by the opening of the next assistant message. The wrapping is
read off the template once, by rendering a short conversation with and without a trailing message, so any template
that ends an assistant message with the EOS token works. A turn cut by a stop string (``</calc>``) never sampled
its EOS: the EOS is inserted before the observation, masked out like the observation, so the model always sees
its message closed as the template closes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Contents no template produces by itself: where they land in the rendering marks the message's bounds.
REPLY, OBSERVATION = "rlpipe-reply-7f3a", "rlpipe-observation-7f3a"


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def episode_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A Hugging Face tokenizer as the episode loop's ``Tokenizer``, which it is: transformers' annotations do not
    show it (the special-token ids come from ``__getattr__``, and ``decode`` is typed for a batch of sequences too)."""
    return tokenizer  # pyright: ignore[reportReturnType]  (transformers' annotations, see above)


class ObservationFormat(Protocol):
    """The rule the episode loop follows after each model turn."""

    @property
    def eos_ends_episode(self) -> bool: ...

    def tokens(self, observation: str, turn_ended_with_eos: bool) -> list[int]:
        """The tokens appended (loss mask 0) for ``observation`` after a model turn."""
        ...


@dataclass(frozen=True)
class VerbatimObservations:
    """The observation's text as it is, right after the model's tokens; the model's EOS ends the episode."""

    tokenizer: Tokenizer
    eos_ends_episode: bool = True

    def tokens(self, observation: str, turn_ended_with_eos: bool) -> list[int]:
        return self.tokenizer.encode(observation, add_special_tokens=False)


@dataclass(frozen=True)
class ChatObservations:
    """Each observation as a chat message: ``before + observation + after``, with ``eos_token_id`` first when the
    model's turn did not end with it. ``before`` holds what the template writes after an assistant message's EOS
    and the opening of the role's message; ``after`` its closing and the opening of the next assistant message."""

    tokenizer: Tokenizer
    eos_token_id: int
    before: str
    after: str
    eos_ends_episode: bool = False

    def tokens(self, observation: str, turn_ended_with_eos: bool) -> list[int]:
        message = self.tokenizer.encode(self.before + observation + self.after, add_special_tokens=False)
        return message if turn_ended_with_eos else [self.eos_token_id, *message]

    @classmethod
    def of(cls, tokenizer: Any, role: str) -> ChatObservations:
        """Read the wrapping of a ``role`` message off ``tokenizer``'s chat template; ValueError naming
        ``rollout.observation_role`` when the template has none, cannot render the role, or does not end an
        assistant message with the EOS token."""
        field = f"rollout.observation_role={role!r}"
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{field} wraps observations in the model's chat template, and the model has none")
        eos = tokenizer.eos_token
        if tokenizer.eos_token_id is None or not eos:
            raise ValueError(f"{field} needs the model's end-of-sequence token, and its tokenizer names none")
        answered = [{"role": "user", "content": "question"}, {"role": "assistant", "content": REPLY}]
        try:
            closed = tokenizer.apply_chat_template(answered, tokenize=False)
            opened = tokenizer.apply_chat_template(
                [*answered, {"role": role, "content": OBSERVATION}], tokenize=False, add_generation_prompt=True
            )
        except Exception as error:  # a template may refuse a role in any way (jinja raises its own errors)
            raise ValueError(f"{field}: the model's chat template cannot render such a message: {error}") from None
        after_reply = closed[closed.index(REPLY) + len(REPLY) :]
        if not after_reply.startswith(eos) or not opened.startswith(closed) or OBSERVATION not in opened:
            raise ValueError(
                f"{field}: the model's chat template does not end an assistant message with its EOS token {eos!r} "
                "and add the next message after it, so a turn the model ended cannot be continued token for token; "
                "leave rollout.observation_role empty and write the chat markers into the observations"
            )
        before, after = opened[len(closed) :].split(OBSERVATION)
        return cls(tokenizer, tokenizer.eos_token_id, after_reply[len(eos) :] + before, after)


def observation_format(tokenizer: Any, role: str) -> ObservationFormat:
    """``rollout.observation_role``'s format: chat messages of ``role``, or verbatim when it is empty."""
    return ChatObservations.of(tokenizer, role) if role else VerbatimObservations(tokenizer)
